"""How the KDA layers of one forward walk its sequences: `KDAPlan`, made with the batch
(`ForwardBatch.kda`) and read by every KDA layer of the forward (`layers/kda.py`) and by the commit
after a verify. Every KDA layer of a forward advances the same sequences in the same calls, so their
offsets, verify blocks and snapshot rounds are worked out once per batch, here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.host_copy import to_device
from hylo.ops import kda as kda_ops
from hylo.ops.kda import CHUNK_TOKENS

# Token offsets of the sequences of one KDA call: (host list, or None when they are on the device
# alone; int32 device copy).
Offsets = tuple[list[int] | None, torch.Tensor]


@dataclass(frozen=True)
class ChunkSnapshotPlan:
    """A prefill batch's snapshots as one KDA call takes them: `chunk_ids` the snapshot id after each
    of the call's chunks (`ChunkSnapshots`; None: none inside a sequence), and the (state slot,
    snapshot id) pairs `end_slots` / `end_ids` of the snapshots at a sequence's end."""

    chunk_ids: torch.Tensor | None
    end_slots: torch.Tensor
    end_ids: torch.Tensor


@dataclass(frozen=True)
class SegmentRound:
    """One round of advancing sequences segment by segment (`KDAAttention._advance_in_segments`): the
    packed `tokens` of each sequence's segment of this round, their state `slots` and `offsets`, and
    the (state slot, snapshot id) pairs `snapshot_slots` / `snapshot_ids` to copy after it."""

    tokens: torch.Tensor
    slots: torch.Tensor
    offsets: Offsets
    snapshot_slots: torch.Tensor
    snapshot_ids: torch.Tensor


@dataclass(frozen=True)
class VerifyPlan:
    """Where a batch's verify chunks and other sequences sit among its packed tokens. Verify chunks
    form `[sequences, T]` blocks, T the longest chunk; a shorter chunk repeats its last token, whose
    outputs are dropped and which no commit reaches."""

    block_tokens: torch.Tensor  # [V, T] packed token of each block position
    block_slots: torch.Tensor  # [V] state slots of the verify chunks
    verified_tokens: torch.Tensor  # packed tokens of the verify chunks ...
    verified_positions: torch.Tensor  # ... and their positions in the flattened blocks
    other_tokens: torch.Tensor  # packed tokens of the other sequences
    other_slots: torch.Tensor
    other_offsets: Offsets
    # the blocks are the batch's packed tokens in order (blocks of one width and nothing else): token
    # t of block j is packed token j·T + t, so the blocks are views of the packed tensors
    whole_batch: bool = False


class KDAPlan:
    """The KDA calls of one batch, from its host lists (`extend_lens`, `verify_seqs`, `seq_slots`,
    `snapshot_points`) and its device state slots `state_slots` (int64); a padded batch (one sequence
    of `padded_lengths [1]` new tokens, then padding: a prefill graph's) has its offsets and chunk
    snapshot ids `padded_chunk_ids` on the device alone.

    Invariants: each part is made on its first read and kept for the batch's life, so that a batch no
    KDA layer reads (a proposer's, a catch-up's, one built inside a capture) uploads nothing, and a
    graph's static batch makes its parts in the warm-up runs, before any capture; a part that depends
    on a step's values reads them from device tensors the graphs update in place (`state_slots`,
    `padded_lengths`), never from a host copy. A padded batch's offsets are made by every read: in a
    graph they are part of the replay.

    Safe to use when: the host lists are the step's (`ForwardBatch.layout` says when they are a
    capture's placeholders: then only `offsets` and a uniform batch's `verify` describe the step)."""

    def __init__(
        self,
        extend_lens: Sequence[int],
        verify_seqs: Sequence[int],
        seq_slots: Sequence[int],
        state_slots: torch.Tensor,
        snapshot_points: dict[int, list[tuple[int, int]]],
        padded_lengths: torch.Tensor | None = None,
        padded_chunk_ids: torch.Tensor | None = None,
    ):
        if padded_lengths is not None and len(extend_lens) != 1:
            raise ValueError("a padded batch holds one sequence (its padding follows its tokens)")
        self.extend_lens, self.verify_seqs, self.seq_slots = extend_lens, verify_seqs, seq_slots
        self.state_slots, self.snapshot_points = state_slots, snapshot_points
        self.padded_lengths, self.padded_chunk_ids = padded_lengths, padded_chunk_ids
        self._offsets: Offsets | None = None
        self._verify: VerifyPlan | None = None
        self._chunk_snapshots: dict[float | None, ChunkSnapshotPlan | None] = {}
        self._rounds: dict[tuple[int, ...], list[SegmentRound]] = {}

    @property
    def device(self) -> torch.device:
        return self.state_slots.device

    def offsets(self) -> Offsets:
        """Token offsets of all the batch's sequences."""
        if self.padded_lengths is not None:
            return None, torch.nn.functional.pad(self.padded_lengths.int(), (1, 0))
        if self._offsets is None:
            self._offsets = _offsets(self.extend_lens, self.device)
        return self._offsets

    def chunk_snapshots(self, lower_bound: float | None) -> ChunkSnapshotPlan | None:
        """The batch's snapshots for one KDA call of layers of gate bound `lower_bound`, or None when the
        call cannot take them: a snapshot inside a sequence off a multiple of `CHUNK_TOKENS` tokens from
        the sequence's first new one, or CUDA layers whose gate the chunked kernels refuse (the
        reference would read the chunk ids back)."""
        if lower_bound not in self._chunk_snapshots:
            takes = self.device.type != "cuda" or kda_ops.chunked_prefill_refusal(lower_bound) is None
            found = self._chunk_snapshot_ids() if takes else None
            self._chunk_snapshots[lower_bound] = (
                None if found is None else self._upload_chunk_snapshots(*found)
            )
        return self._chunk_snapshots[lower_bound]

    def _upload_chunk_snapshots(self, chunk_ids: list[int], ends: list[tuple[int, int]]) -> ChunkSnapshotPlan:
        ends_d = to_device(ends, self.device, torch.long).view(-1, 2)
        inner = to_device(chunk_ids, self.device, torch.long) if max(chunk_ids, default=-1) >= 0 else None
        return ChunkSnapshotPlan(inner, ends_d[:, 0], ends_d[:, 1])

    def _chunk_snapshot_ids(self) -> tuple[list[int], list[tuple[int, int]]] | None:
        """(snapshot id after each KDA chunk of the batch's sequences, (state slot, snapshot id) of each
        snapshot at a sequence's end), or None if a snapshot inside a sequence is off a chunk boundary."""
        chunk_ids, ends = [], []
        for i, n in enumerate(self.extend_lens):
            ids = [-1] * -(-n // CHUNK_TOKENS)
            for point, sid in self.snapshot_points.get(i, []):
                if point == n:
                    ends.append((self.seq_slots[i], sid))
                elif 0 < point < n and point % CHUNK_TOKENS == 0:
                    ids[point // CHUNK_TOKENS - 1] = sid
                else:
                    return None
            chunk_ids += ids
        return chunk_ids, ends

    def segment_rounds(self, seqs: tuple[int, ...]) -> list[SegmentRound]:
        """The rounds that advance sequences `seqs` (batch indices) segment by segment, their chunks
        split at their snapshot points: round r advances every sequence's r-th segment."""
        if seqs not in self._rounds:
            self._rounds[seqs] = self._make_rounds(seqs)
        return self._rounds[seqs]

    def _make_rounds(self, seqs: tuple[int, ...]) -> list[SegmentRound]:
        offsets, _ = self.offsets()
        device, slots = self.device, self.seq_slots
        bounds, ids = {}, {}
        for i in seqs:
            n, points = self.extend_lens[i], self.snapshot_points.get(i, [])
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
            copies = [(slots[i], ids[i][bounds[i][r + 1]]) for i in live if bounds[i][r + 1] in ids[i]]
            copies_d = to_device(copies, device, torch.long).view(-1, 2)
            rounds.append(SegmentRound(
                to_device(index, device, torch.long), to_device([slots[i] for i in live], device, torch.long),
                _offsets(lengths, device), copies_d[:, 0], copies_d[:, 1],
            ))  # fmt: skip
        return rounds

    def verify(self) -> VerifyPlan:
        """Where the verify chunks and the other sequences sit (a batch with verify chunks)."""
        if self._verify is None:
            self._verify = self._make_verify()
        return self._verify

    def _make_verify(self) -> VerifyPlan:
        device, lens = self.device, self.extend_lens
        offsets, _ = self.offsets()
        verify = set(self.verify_seqs)
        width = max(lens[i] for i in verify)
        if len(verify) == len(lens) and all(n == width for n in lens):
            # blocks of one width and nothing else (a verify graph's batch): the plan is the batch's own
            # tensors, so that a replay with other slots reads them
            tokens = torch.arange(len(lens), device=device)[:, None] * width
            blocks = tokens + torch.arange(width, device=device)
            flat, empty = blocks.flatten(), torch.zeros(0, dtype=torch.long, device=device)
            return VerifyPlan(
                blocks, self.state_slots, flat, flat, empty, empty, _offsets([], device), whole_batch=True
            )
        blocks, verified, positions = [], [], []
        for row, i in enumerate(self.verify_seqs):
            lo, n = offsets[i], lens[i]
            blocks.append([lo + min(t, n - 1) for t in range(width)])
            verified += range(lo, lo + n)
            positions += range(row * width, row * width + n)
        others = [i for i in range(len(lens)) if i not in verify]
        other_tokens = [t for i in others for t in range(offsets[i], offsets[i] + lens[i])]

        def dev(values) -> torch.Tensor:
            return to_device(values, device, torch.long)

        return VerifyPlan(
            dev(blocks), dev([self.seq_slots[i] for i in self.verify_seqs]), dev(verified), dev(positions),
            dev(other_tokens), dev([self.seq_slots[i] for i in others]),
            _offsets([lens[i] for i in others], device),
        )  # fmt: skip


def _offsets(lengths: Sequence[int], device: torch.device) -> Offsets:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets, to_device(offsets, device, torch.int32)
