"""Triton batch metadata: one launch for the ~25 small kernels of `reference.uniform_metadata` (a
fixed-shape step builds it once per forward: the target's, and each draft forward's). One program per
sequence writes its tokens' positions, rows and cache slots, its completable pools and its row of the
pool table, reading the request table directly. Integer arithmetic only: the results are the
reference's exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.batch_metadata.operands import FirstTokens, Metadata, RequestTable, Sequences, StepShape
from hylo.ops.batch_metadata.reference import InFlight
from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter

BLOCK_TOKENS = 64  # tokens of a sequence per loop step (a decode or verify row is one step)
BLOCK_POOLS = 256  # pool-table columns per loop step


@triton.jit
def _uniform_metadata_kernel(
    seqs, table, out, shape, in_flight,
    HAS_LENGTHS: tl.constexpr, HAS_FILLER: tl.constexpr, IN_FLIGHT: tl.constexpr, AFTER: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_POOLS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program b writes sequence b's entries of `out` (`Metadata`) from `seqs` (`Sequences`) and the
    request `table` (`RequestTable`), at the step's `shape` (`StepShape`), and with IN_FLIGHT resolves
    its first token from `in_flight` (`FirstTokens`)."""
    enter(PDL)
    width, kpool, candidates, pool_columns = shape.width, shape.kpool, shape.candidates, shape.pool_columns
    slots, table_stride = table.slots, table.row_stride
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(seqs.prefix + b).to(tl.int64)
    row = tl.load(seqs.rows + b).to(tl.int64)
    if IN_FLIGHT:  # the uploaded first token, or the row's last sampled one (`reference.InFlight`)
        f = in_flight
        token = tl.load(f.first + b).to(tl.int64)
        token = tl.where(token == f.marker, tl.load(f.last_sampled + row).to(tl.int64), token)
        tl.store(f.ids + b * f.ids_stride, token)
        if AFTER:
            start += tl.load(f.after + b).to(tl.int64) * tl.load(f.last_committed + row).to(tl.int64)
    count = width
    if HAS_LENGTHS:
        count = tl.load(seqs.lengths + b).to(tl.int64)
    end = start + count
    pools_after = end // kpool
    tl.store(out.state_slots + b, row)
    filler_slot = 0
    if HAS_FILLER:
        filler_slot = tl.load(slots + shape.filler_row * table_stride).to(tl.int64)
    for w0 in range(0, width, BLOCK_TOKENS):
        t = w0 + tl.arange(0, BLOCK_TOKENS)
        inside = t < width
        position = start + t
        if HAS_LENGTHS:
            position = tl.minimum(position, end - 1)
        slot = tl.load(slots + row * table_stride + position, mask=inside, other=0).to(tl.int64)
        if HAS_LENGTHS:
            slot = tl.where(t < count, slot, filler_slot)
        tl.store(out.positions + b * width + t, position, mask=inside)
        tl.store(out.token_rows + b * width + t, tl.zeros_like(t).to(tl.int64) + row, mask=inside)
        tl.store(out.new_slots + b * width + t, slot, mask=inside)
    first_pool = start // kpool
    for c0 in range(0, candidates, BLOCK_POOLS):
        c = c0 + tl.arange(0, BLOCK_POOLS)
        inside = c < candidates
        pool = first_pool + c
        completes = pool < pools_after
        pool_row = tl.zeros_like(c).to(tl.int64) + row
        if HAS_FILLER:
            pool_row = tl.where(completes, pool_row, shape.filler_row)
            pool = tl.where(completes, pool, 0)
        else:
            pool = tl.where(completes, pool, first_pool)
        entry = tl.load(slots + pool_row * table_stride + pool * kpool, mask=inside, other=0).to(tl.int64)
        tl.store(out.completed_pools + b * candidates + c, entry // kpool, mask=inside)
    for q0 in range(0, pool_columns, BLOCK_POOLS):
        q = q0 + tl.arange(0, BLOCK_POOLS)
        inside = q < pool_columns
        entry = tl.load(slots + row * table_stride + q * kpool, mask=inside, other=0).to(tl.int64)
        tl.store(
            out.pool_table + b * pool_columns + q, tl.where(q < pools_after, entry // kpool, -1), mask=inside
        )


def uniform_metadata(
    prefix: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
    kpool: int,
    filler_row: int | None,
    lengths: torch.Tensor | None,
    out: dict[str, torch.Tensor],
    in_flight: InFlight | None = None,
) -> dict[str, torch.Tensor]:
    """Triton twin of `reference.uniform_metadata` for the calls `refusal` takes, written into `out`
    (every name the reference returns, int64, contiguous, of the reference's sizes), after
    `reference.resolve_in_flight` where `in_flight` is given (in the same launch); returns `out`."""
    f = in_flight
    after = f is not None and f.after is not None
    dependent = dependent_launches(prefix.device)
    _uniform_metadata_kernel[(prefix.shape[0],)](
        Sequences.of(prefix, rows, lengths), RequestTable.of(req_to_token), Metadata.of(out),
        StepShape.of(width, kpool, req_to_token, filler_row), FirstTokens.of(f, prefix),
        HAS_LENGTHS=lengths is not None, HAS_FILLER=filler_row is not None, IN_FLIGHT=f is not None,
        AFTER=after, BLOCK_TOKENS=BLOCK_TOKENS, BLOCK_POOLS=BLOCK_POOLS, num_warps=4,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return out
