"""The Triton kernel of `block_inputs`: one launch in place of the reference's ~20 small ops.

Program (b, c) writes column c of sequence b: its hidden row and its token. Program (b, 0) also
reads the old `last_hidden[rows[b]]` before writing the new one (each thread loads, then stores, the
same elements, so the order holds without a barrier), and writes b's prefix, first row and chain
positions. Rows must be distinct where their values are read: a filler sequence's row (the scratch
row, shared by every filler of a fixed-shape batch) may race with another filler's, whose MTP entry
is never read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.mtp_inputs.operands import RowStrides
from hylo.ops.mtp_inputs.reference import BlockInputs, VerifiedBlocks

# hidden elements one program moves per step
BLOCK_H = 2048


@triton.jit
def _block_inputs_kernel(
    last_hidden, rows, verified, out, blocks, last, row_strides,
    W: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, CHAIN: tl.constexpr,
):  # fmt: skip
    """Program (b, c): column c of sequence b (module docstring) from `verified` (`VerifiedBlocks`) and
    `last_hidden [rows, H]` at `rows [B]` into `out` (`BlockInputs`, contiguous, `chain [CHAIN,
    blocks]`), the chain's positions at most `last`; `row_strides` (`RowStrides`) address the 2-D
    operands."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    features = verified.features
    count = tl.load(verified.counts + b).to(tl.int64)
    out_row = out.hidden + (b * (W + 1) + c) * H
    if c == 0:
        row = tl.load(rows + b).to(tl.int64)
        first_packed = tl.load(verified.pad_index + b * row_strides.pad_index).to(tl.int64)
        kept = features + (first_packed + tl.maximum(count, 1) - 1) * row_strides.features
        old_row = last_hidden + row * row_strides.last_hidden
        for h0 in tl.static_range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            old = tl.load(old_row + h, mask=h < H)
            tl.store(out_row + h, old, mask=h < H)
            tl.store(old_row + h, tl.load(kept + h, mask=h < H), mask=h < H)
        start = tl.load(verified.positions + first_packed).to(tl.int64)
        tl.store(out.prefix + b, tl.maximum(start - 1, 0))
        tl.store(out.first + b, b * (W + 1) + count)
        for s in tl.static_range(CHAIN):
            tl.store(out.chain + s * blocks + b, tl.minimum(start + count + s, last))
    else:
        src = features + (b * W + c - 1) * row_strides.features
        for h0 in tl.static_range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            tl.store(out_row + h, tl.load(src + h, mask=h < H), mask=h < H)
    token = tl.load(verified.input_ids + b * W + tl.minimum(c, W - 1))
    token = tl.where(c == count, tl.load(verified.anchors + b), token)
    tl.store(out.tokens + b * (W + 1) + c, token)


def block_inputs(
    verified: VerifiedBlocks, last_hidden: torch.Tensor, rows: torch.Tensor, chain_steps: int, last: int
) -> BlockInputs:
    """Same contract as `reference.block_inputs`, one launch (calls `refusal` in the package lets through)."""
    features, input_ids, positions = verified.features, verified.input_ids, verified.positions
    blocks, width, hidden_size = rows.shape[0], verified.width, features.shape[1]
    device = features.device
    hidden = torch.empty(blocks, width + 1, hidden_size, dtype=features.dtype, device=device)
    tokens = torch.empty(blocks * (width + 1), dtype=input_ids.dtype, device=device)
    prefix = torch.empty(blocks, dtype=positions.dtype, device=device)
    first = torch.empty(blocks, dtype=torch.int64, device=device)
    chain = torch.empty(chain_steps, blocks, dtype=torch.int64, device=device)
    out = BlockInputs(hidden, tokens, prefix, first, chain)
    _block_inputs_kernel[(blocks, width + 1)](
        last_hidden, rows, verified, out, blocks, last, RowStrides.of(last_hidden, verified),
        W=width, H=hidden_size, BH=min(BLOCK_H, triton.next_power_of_2(hidden_size)), CHAIN=chain_steps,
        num_warps=4,
    )  # fmt: skip
    return out
