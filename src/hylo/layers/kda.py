"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.host_copy import to_device
from hylo.layers.linear import FusedLinear, Linear
from hylo.ops import kda as kda_ops
from hylo.ops.kda.reference import CHUNK_TOKENS
from hylo.parallel.layout import SINGLE, Parallel


class KDAAttention(nn.Module):
    """q|k|v projections, one depthwise causal conv over the three, safe-gated delta rule, gated norm.
    The projections of the layer input run as two GEMMs (`qkvb_proj`, `fg_a_proj`).

    `conv_weight [3·H·d, K]` is the checkpoint's q_conv1d, k_conv1d and v_conv1d stacked in that order.
    Under tensor parallelism H is this rank's heads: every per-head tensor (q/k/v, f_b, g_b, b, dt_bias,
    A_log, the conv channels, the state slots) is split by head, f_a and g_a are replicated, and
    o_proj is row parallel (its partial sums are all-reduced).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, parallel: Parallel = SINGLE):
        super().__init__()
        d, hidden = config.linear_head_dim, config.hidden_size
        h = parallel.part(config.linear_num_heads, "linear_num_heads")
        self.layer_idx, self.num_heads, self.head_dim, self.parallel = layer_idx, h, d, parallel
        self.lower_bound, self.eps = config.linear_lower_bound, config.rms_norm_eps
        # q, k, v, b, f_a and g_a read the same input: two GEMMs, one of the per-head projections (split
        # by head under tensor parallelism) and one of the replicated low-rank ones
        self.qkvb_proj = FusedLinear(
            hidden, (("q_proj", h * d), ("k_proj", h * d), ("v_proj", h * d), ("b_proj", h))
        )
        self.fg_a_proj = FusedLinear(hidden, (("f_a_proj", d), ("g_a_proj", d)))
        self.conv_weight = nn.Parameter(
            torch.empty(3 * h * d, config.linear_conv_kernel_dim, dtype=torch.float32)
        )
        self.f_b_proj = Linear(d, h * d)
        self.dt_bias = nn.Parameter(torch.empty(h * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.g_b_proj = Linear(d, h * d)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = Linear(h * d, hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Packed tokens in, packed out. Sequences advance their slots' conv windows and states in place
        (a step of single tokens by the decode kernels, anything else by the varlen chunked prefill),
        except verify chunks: they run as one block per sequence from the committed state, which stays
        untouched, and leave in `batch.kda_records` what `commit` needs to advance it afterwards."""
        tokens, heads = x.shape[0], (self.num_heads, self.head_dim)
        q, k, v, b = self.qkvb_proj(x)
        f_a, g_a = self.fg_a_proj(x)
        qkvfb = kda_ops.KDAInputs(q, k, v, self.f_b_proj(f_a), b)
        if not batch.verify_seqs and batch.snapshot_points:
            o = self._advance_taking_snapshots(qkvfb, batch)
        elif not batch.verify_seqs:
            o = self._advance(qkvfb, batch.state_slots, *_cu_seqlens(batch), batch)
        else:
            plan = _verify_plan(batch)
            o = x.new_empty(tokens, *heads)
            blocks = qkvfb.rows(plan.block_tokens)  # [sequences, T, ...], short blocks padded
            o_blocks, batch.kda_records[self.layer_idx] = kda_ops.verify(
                blocks, self.params, self._slots(batch, plan.block_slots)
            )
            o[plan.verified_tokens] = o_blocks.flatten(0, 1)[plan.verified_positions]
            if batch.snapshot_points:  # prefill chunks beside the blocks leave prefix snapshots
                verify = set(batch.verify_seqs)
                others = [i for i in range(len(batch.extend_lens)) if i not in verify]
                self._advance_in_segments(qkvfb, others, batch, o)
            elif plan.other_slots.numel():
                rest = qkvfb.rows(plan.other_tokens)
                o[plan.other_tokens] = self._advance(rest, plan.other_slots, *plan.other_cu, batch)
        gate = self.g_b_proj(g_a).unflatten(-1, heads)
        o = kda_ops.gated_norm(o, gate, self.o_norm.weight, self.eps)
        return self.parallel.all_reduce(self.o_proj(o.reshape(tokens, -1)))

    def commit(self, batch: ForwardBatch, n_accepted: torch.Tensor) -> None:
        """Advance each verify chunk's window and state by its first `n_accepted[j]` tokens (int32,
        device), from what the verify forward recorded."""
        plan = _verify_plan(batch)
        record = batch.kda_records.pop(self.layer_idx)
        kda_ops.commit(record, self.params, self._slots(batch, plan.block_slots), n_accepted)

    @property
    def params(self) -> kda_ops.KDAParams:
        return kda_ops.KDAParams(self.conv_weight, self.dt_bias, self.A_log, self.lower_bound)

    def _slots(self, batch: ForwardBatch, slots: torch.Tensor) -> kda_ops.KDASlots:
        layer = batch.states.kda_index[self.layer_idx]
        return kda_ops.KDASlots(batch.states.conv[layer], batch.states.recurrent[layer], slots)

    def _advance_taking_snapshots(self, qkvfb: kda_ops.KDAInputs, batch: ForwardBatch) -> torch.Tensor:
        """Advance every sequence of a prefill batch that leaves prefix-cache snapshots: in one call
        whose chunk kernels take those inside the sequences (`_chunk_snapshots`), the windows and states
        of those at a sequence's end copied from its slot after it; in segments where a snapshot falls
        off the KDA chunks' boundaries."""
        plan = _chunk_snapshots(batch, self.lower_bound)
        if plan is None:
            o = qkvfb.q.new_empty(qkvfb.q.shape[0], self.num_heads, self.head_dim)
            self._advance_in_segments(qkvfb, range(len(batch.extend_lens)), batch, o)
            return o
        o = self._advance(qkvfb, batch.state_slots, *_cu_seqlens(batch), batch, plan.chunk_ids)
        if plan.end_ids.numel():
            layer, pool = batch.states.kda_index[self.layer_idx], batch.snapshot_pool
            pool.conv[layer, plan.end_ids] = batch.states.conv[layer, plan.end_slots]
            pool.recurrent[layer, plan.end_ids] = batch.states.recurrent[layer, plan.end_slots]
        return o

    def _advance_in_segments(self, qkvfb, seqs, batch: ForwardBatch, o: torch.Tensor) -> None:
        """Advance sequences `seqs` (batch indices) segment by segment, their chunks split at their
        snapshot points (`ForwardBatch.snapshot_points`): round r advances every sequence's r-th
        segment in one call, then copies the windows and states of the sequences whose segment ended
        at a point into those snapshots. Outputs go to `o` at the sequences' packed tokens."""
        layer = batch.states.kda_index[self.layer_idx]
        for index, slots, cu_cpu, cu, snapshot_slots, snapshot_ids in _segment_rounds(batch, tuple(seqs)):
            o[index] = self._advance(qkvfb.rows(index), slots, cu_cpu, cu, batch)
            if snapshot_ids.numel():
                pool = batch.snapshot_pool
                pool.conv[layer, snapshot_ids] = batch.states.conv[layer, snapshot_slots]
                pool.recurrent[layer, snapshot_ids] = batch.states.recurrent[layer, snapshot_slots]

    def _advance(
        self,
        qkvfb: kda_ops.KDAInputs,
        slots: torch.Tensor,
        cu_cpu: list[int] | None,
        cu: torch.Tensor,
        batch: ForwardBatch,
        chunk_snapshots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`chunk_snapshots`: the snapshot id after each KDA chunk of the call (`ChunkSnapshots`), if
        not the padded batch's."""
        if cu_cpu is not None and cu_cpu[-1] == len(cu_cpu) - 1:  # one token per sequence
            return kda_ops.decode(qkvfb, self.params, self._slots(batch, slots))
        snapshots = None
        chunk_ids = batch.padded_snapshots if chunk_snapshots is None else chunk_snapshots
        if chunk_ids is not None:
            layer, pool = batch.states.kda_index[self.layer_idx], batch.snapshot_pool
            snapshots = kda_ops.ChunkSnapshots(chunk_ids, pool.conv[layer], pool.recurrent[layer])
        return kda_ops.prefill(qkvfb, self.params, self._slots(batch, slots), cu, cu_cpu, snapshots)


def _cu_seqlens(batch: ForwardBatch) -> tuple[list[int] | None, torch.Tensor]:
    """Token offsets of the batch's sequences (host list, int32 device copy), made once per batch. A
    padded batch's (one sequence, `padded_lens`) are on the device alone, (None, [0, n]), made by
    every call: in a graph they are part of the replay."""
    if batch.padded_lens is not None:
        if len(batch.extend_lens) != 1:
            raise ValueError("a padded batch holds one sequence (its padding follows its tokens)")
        return None, torch.nn.functional.pad(batch.padded_lens.int(), (1, 0))
    cached = batch.__dict__.get("_kda_cu_seqlens")
    if cached is None:
        cached = batch.__dict__["_kda_cu_seqlens"] = _offsets(batch.extend_lens, batch.state_slots.device)
    return cached


@dataclass(frozen=True)
class ChunkSnapshotPlan:
    """A prefill batch's snapshots as one KDA call takes them: `chunk_ids` the snapshot id after each
    of the call's chunks (`ChunkSnapshots`; None: none inside a sequence), and the (state slot,
    snapshot id) pairs `end_slots` / `end_ids` of the snapshots at a sequence's end."""

    chunk_ids: torch.Tensor | None
    end_slots: torch.Tensor
    end_ids: torch.Tensor


def _chunk_snapshots(batch: ForwardBatch, lower_bound: float | None) -> ChunkSnapshotPlan | None:
    """The batch's snapshots for one KDA call (made once per batch, shared by every KDA layer), or None
    when the call cannot take them: a snapshot inside a sequence off a multiple of `CHUNK_TOKENS`
    tokens from the sequence's first new one, or a CUDA layer whose gate the chunked kernels refuse
    (the reference would read the chunk ids back)."""
    cache = batch.__dict__
    if "_kda_chunk_snapshots" not in cache:
        device = batch.state_slots.device
        found = None
        if device.type != "cuda" or kda_ops.chunked_prefill_refusal(lower_bound) is None:
            found = _chunk_snapshot_ids(batch)
        if found is None:
            cache["_kda_chunk_snapshots"] = None
        else:
            chunk_ids, ends = found
            ends_d = to_device(ends, device, torch.long).view(-1, 2)
            inner = to_device(chunk_ids, device, torch.long) if max(chunk_ids, default=-1) >= 0 else None
            cache["_kda_chunk_snapshots"] = ChunkSnapshotPlan(inner, ends_d[:, 0], ends_d[:, 1])
    return cache["_kda_chunk_snapshots"]


def _chunk_snapshot_ids(batch: ForwardBatch) -> tuple[list[int], list[tuple[int, int]]] | None:
    """(snapshot id after each KDA chunk of the batch's sequences, (state slot, snapshot id) of each
    snapshot at a sequence's end), or None if a snapshot inside a sequence is off a chunk boundary."""
    chunk_ids, ends = [], []
    for i, n in enumerate(batch.extend_lens):
        ids = [-1] * -(-n // CHUNK_TOKENS)
        for point, sid in batch.snapshot_points.get(i, []):
            if point == n:
                ends.append((batch.seq_slots[i], sid))
            elif 0 < point < n and point % CHUNK_TOKENS == 0:
                ids[point // CHUNK_TOKENS - 1] = sid
            else:
                return None
        chunk_ids += ids
    return chunk_ids, ends


def _segment_rounds(batch: ForwardBatch, seqs: tuple[int, ...]) -> list[tuple]:
    """The rounds of `KDAAttention._advance_in_segments` for `seqs` (made once per batch, shared by
    every KDA layer): per round the packed tokens, the state slots and offsets of the segments, and
    the (state slot, snapshot id) pairs to copy after it."""
    cache = batch.__dict__.setdefault("_kda_segment_rounds", {})
    if seqs in cache:
        return cache[seqs]
    offsets, _ = _cu_seqlens(batch)
    device = batch.state_slots.device
    bounds, ids = {}, {}
    for i in seqs:
        n, points = batch.extend_lens[i], batch.snapshot_points.get(i, [])
        bounds[i] = [0, *(k for k, _ in points if k < n), n]
        ids[i] = dict(points)
    rounds = []
    for r in range(max(len(b) for b in bounds.values()) - 1):
        live = [i for i in seqs if r + 1 < len(bounds[i])]
        index, lengths = [], []
        for i in live:
            lo, hi = bounds[i][r], bounds[i][r + 1]
            index += range(offsets[i] + lo, offsets[i] + hi)
            lengths.append(hi - lo)
        copies = [(batch.seq_slots[i], ids[i][bounds[i][r + 1]]) for i in live if bounds[i][r + 1] in ids[i]]
        copies_d = to_device(copies, device, torch.long).view(-1, 2)
        rounds.append((
            to_device(index, device, torch.long),
            to_device([batch.seq_slots[i] for i in live], device, torch.long),
            *_offsets(lengths, device), copies_d[:, 0], copies_d[:, 1],
        ))  # fmt: skip
    cache[seqs] = rounds
    return rounds


def _offsets(lengths: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets, torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)


@dataclass
class VerifyPlan:
    """Where a batch's verify chunks and other sequences sit among its packed tokens (built once per
    batch, shared by every KDA layer). Verify chunks form `[sequences, T]` blocks, T the longest chunk;
    a shorter chunk repeats its last token, whose outputs are dropped and which no commit reaches."""

    block_tokens: torch.Tensor  # [V, T] packed token of each block position
    block_slots: torch.Tensor  # [V] state slots of the verify chunks
    verified_tokens: torch.Tensor  # packed tokens of the verify chunks ...
    verified_positions: torch.Tensor  # ... and their positions in the flattened blocks
    other_tokens: torch.Tensor  # packed tokens of the other sequences
    other_slots: torch.Tensor
    other_cu: tuple[list[int], torch.Tensor]


def _verify_plan(batch: ForwardBatch) -> VerifyPlan:
    cached = batch.__dict__.get("_kda_verify_plan")
    if cached is not None:
        return cached
    device = batch.state_slots.device
    offsets, _ = _cu_seqlens(batch)
    verify = set(batch.verify_seqs)
    width = max(batch.extend_lens[i] for i in verify)
    if len(verify) == len(batch.extend_lens) and all(n == width for n in batch.extend_lens):
        # blocks of one width and nothing else (a verify graph's batch): the plan is the batch's own
        # tensors, so that a replay with other slots reads them
        tokens = torch.arange(len(offsets) - 1, device=device)[:, None] * width
        blocks = tokens + torch.arange(width, device=device)
        flat, empty = blocks.flatten(), torch.zeros(0, dtype=torch.long, device=device)
        plan = VerifyPlan(blocks, batch.state_slots, flat, flat, empty, empty, _offsets([], device))
        batch.__dict__["_kda_verify_plan"] = plan
        return plan
    blocks, verified, positions = [], [], []
    for row, i in enumerate(batch.verify_seqs):
        lo, n = offsets[i], batch.extend_lens[i]
        blocks.append([lo + min(t, n - 1) for t in range(width)])
        verified += range(lo, lo + n)
        positions += range(row * width, row * width + n)
    others = [i for i in range(len(batch.extend_lens)) if i not in verify]
    other_tokens = [t for i in others for t in range(offsets[i], offsets[i] + batch.extend_lens[i])]

    def dev(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    plan = batch.__dict__["_kda_verify_plan"] = VerifyPlan(
        dev(blocks), dev([batch.seq_slots[i] for i in batch.verify_seqs]), dev(verified), dev(positions),
        dev(other_tokens), dev([batch.seq_slots[i] for i in others]),
        _offsets([batch.extend_lens[i] for i in others], device),
    )  # fmt: skip
    return plan
