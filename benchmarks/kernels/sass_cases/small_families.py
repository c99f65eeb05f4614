"""Four small kernel families: a fixed-shape batch's metadata (`ops/batch_metadata`: decode at B = 1 and 8,
a verify step's in-flight first tokens with and without a commit in flight, a padded prefill), an MTP
verify block's inputs (`ops/mtp_inputs`, B = 1 and 8), DFlash2's grouped block conv (`ops/block_conv`,
one and eight blocks) and the RMSNorms (`ops/norm`: one norm, a DSA layer's q_a/kv_a pair into the
latent cache, an MTP layer's enorm|hnorm side by side)."""

from __future__ import annotations

import torch
from code_size import HIDDEN, KPOOL

from hylo.ops import batch_metadata
from hylo.ops.batch_metadata import InFlight
from hylo.ops.batch_metadata import kernels as metadata_kernels
from hylo.ops.block_conv import kernels as block_conv_kernels
from hylo.ops.mtp_inputs import VerifiedBlocks
from hylo.ops.mtp_inputs import kernels as mtp_inputs_kernels
from hylo.ops.norm import NormRows, RowStore
from hylo.ops.norm import kernels as norm_kernels

BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64
MODULES = (metadata_kernels, norm_kernels)
TABLE_ROWS, CONTEXT = 64, 65536  # request-table rows (the last the scratch row), token slots a row
Q_LORA, KV_LORA, INDEX_PARTS = 1536, 512, 128 + 32  # in_proj's fused output: q_a | kv_a | the indexer's


def metadata(batch: int, width: int, filler: bool, padded: bool, in_flight: str | None = None) -> None:
    """`uniform_metadata` of `batch` sequences of `width` tokens from the uploaded int64 inputs (rows of
    one `[4, B]` tensor, as a captured step uploads them); `in_flight`: "first" resolves the first
    tokens, "after" also starts after an in-flight commit."""
    inputs = torch.zeros(4, batch, dtype=I64)
    table = torch.zeros(TABLE_ROWS, CONTEXT, dtype=I32)
    sizes = batch_metadata.output_sizes(batch, width, table, KPOOL)
    out = {name: torch.zeros(size, dtype=I64) for name, size in sizes.items()}
    flight = None
    if in_flight is not None:
        ids = torch.zeros(batch, width, dtype=I64)[:, 0]  # the step's input ids, a sequence's first
        after = (inputs[3], torch.zeros(TABLE_ROWS, dtype=I32)) if in_flight == "after" else (None, None)
        flight = InFlight(inputs[2], -1, torch.zeros(TABLE_ROWS, dtype=I64), ids, *after)
    lengths = torch.ones(batch, dtype=I64) if padded else None
    metadata_kernels.uniform_metadata(
        inputs[0], inputs[1], width, table, KPOOL, TABLE_ROWS - 1 if filler else None, lengths, out, flight
    )


def block_inputs(batch: int, width: int = 4, chain_steps: int = 2) -> None:
    """An MTP verify block's inputs after a uniform verify of `width` tokens a sequence."""
    verified = VerifiedBlocks(
        torch.zeros(batch * width, HIDDEN, dtype=BF16),
        torch.zeros(batch * width, dtype=I64),
        torch.zeros(batch * width, dtype=I64),
        torch.zeros(batch, width, dtype=I64),
        torch.zeros(batch, dtype=I64),
        torch.zeros(batch, dtype=I64),
    )
    last_hidden = torch.zeros(TABLE_ROWS, HIDDEN, dtype=BF16)
    rows = torch.zeros(batch, dtype=I64)
    mtp_inputs_kernels.block_inputs(verified, last_hidden, rows, chain_steps, CONTEXT - 1)


def block_conv(blocks: int, rows: int = 16, taps: int = 4, group: int = 16) -> None:
    """DFlash2's conv of `blocks` blocks of `rows` rows, its deltas one side's view of the projection's
    output (`GroupedBlockConv.forward`)."""
    x = torch.zeros(blocks, rows, HIDDEN, dtype=BF16)
    base = torch.zeros(2, taps, HIDDEN, dtype=BF16)[1]
    deltas = torch.zeros(blocks, rows, 2, taps, HIDDEN // group, dtype=BF16)[..., 1, :, :]
    block_conv_kernels.grouped_block_conv(x, base, deltas, group)


def norm_pair(tokens: int) -> None:
    """A DSA layer's q_a norm and kv_a norm into the latent cache, both column views of in_proj's output."""
    fused = torch.zeros(tokens, Q_LORA + KV_LORA + INDEX_PARTS, dtype=BF16)
    q_a, kv_a, _ = fused.split([Q_LORA, KV_LORA, INDEX_PARTS], dim=1)
    first = NormRows(q_a, torch.ones(Q_LORA, dtype=BF16), 1e-6)
    second = NormRows(kv_a, torch.ones(KV_LORA, dtype=BF16), 1e-6)
    store = RowStore(torch.zeros(TABLE_ROWS * 1024, KV_LORA, dtype=BF16), torch.zeros(tokens, dtype=I64))
    norm_kernels.rms_norm_pair(first, second, store)


def norm_cat(tokens: int) -> None:
    """An MTP layer's enorm and hnorm of its embeddings and hiddens."""
    weight = torch.ones(HIDDEN, dtype=BF16)
    rows = NormRows(torch.zeros(tokens, HIDDEN, dtype=BF16), weight, 1e-5)
    norm_kernels.rms_norm_cat(rows, NormRows(torch.zeros(tokens, HIDDEN, dtype=BF16), weight, 1e-5))


CASES = {
    "metadata_decode_b1": lambda: metadata(1, 1, filler=False, padded=False),
    "metadata_decode_b8_first": lambda: metadata(8, 1, filler=True, padded=False, in_flight="first"),
    "metadata_verify_b8_after": lambda: metadata(8, 4, filler=True, padded=False, in_flight="after"),
    "metadata_prefill_padded_b1": lambda: metadata(1, 64, filler=True, padded=True),
    "block_inputs_b1": lambda: block_inputs(1),
    "block_inputs_b8": lambda: block_inputs(8),
    "block_conv_r1": lambda: block_conv(1),
    "block_conv_r8": lambda: block_conv(8),
    "rms_norm_t8": lambda: norm_kernels.rms_norm(
        torch.zeros(8, HIDDEN, dtype=BF16), torch.ones(HIDDEN, dtype=BF16), 1e-5
    ),
    "norm_pair_t1": lambda: norm_pair(1),
    "norm_pair_t8": lambda: norm_pair(8),
    "norm_cat_t8": lambda: norm_cat(8),
}
