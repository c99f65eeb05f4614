"""Metadata of one model forward over a batch of sequences: built once on the CPU (`ForwardBatch.build`),
or on the device from device lengths alone (`ForwardBatch.uniform`, what a CUDA graph builds inside
its capture)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.ops.kda.reference import VerifyCache


@dataclass
class SequenceChunk:
    """One sequence's share of a forward: `token_ids` are appended after `prefix_len` cached tokens.

    `table_row` is the sequence's row of the request table (its positions' token-cache slots, backed
    for every position `< prefix_len + len(token_ids)`); `state_slot` its KDA state slot. With
    `sample`, the forward returns logits for the chunk's last token; a `score` chunk returns them for
    every token (prompt logprobs). A `verify` chunk (an anchor and its drafts) returns logits for
    every token and leaves the KDA state of its slot untouched: the accepted prefix is committed
    afterwards (`Glm5NextForCausalLM.commit`). An `after_commit` verify chunk starts where the verify
    step still in flight on its row leaves it: `prefix_len` plus the positions that step commits
    (`CacheManager.last_committed`, known on the device only), from the anchor it leaves; only the
    verify graphs, which read both on the device, take one (`Request.verifying`).
    """

    token_ids: Sequence[int]
    prefix_len: int
    table_row: int
    state_slot: int
    sample: bool = True
    verify: bool = False
    score: bool = False
    # (tokens of the chunk, snapshot id): copy every KDA layer's state after that many of its tokens
    # into that prefix-cache snapshot (`ForwardBatch.snapshot_points`)
    snapshots: Sequence[tuple[int, int]] = ()
    after_commit: bool = False


@dataclass(frozen=True)
class FixedShape:
    """Shapes a batch keeps from one step to the next, so that a CUDA graph captured on one batch can
    replay another: `num_seqs` sequences (the chunks, then filler sequences of `tokens_per_seq`
    tokens at the start of the request-table row and KDA state slot `filler_slot`; verify blocks when
    `tokens_per_seq > 1`) and `num_seqs · ceil(tokens_per_seq / kpool)` entries in `completed_pools`
    (padded with the pool at position 0 of `filler_slot`'s row), the most that many tokens per
    sequence can complete. The filler slot's row and state must belong to no request. The
    `pool_table` keeps the batch's own width, at most `pool_width` pools: a graph's static batch holds
    `pool_width` columns, of which a step fills the first ones (so a step's cost follows its
    sequences' lengths, not the context length)."""

    num_seqs: int
    pool_width: int
    filler_slot: int
    tokens_per_seq: int = 1
    kpool: int = 1

    @property
    def num_completed(self) -> int:
        return self.num_seqs * -(-self.tokens_per_seq // self.kpool)

    def pad(self, chunks: Sequence[SequenceChunk]) -> list[SequenceChunk]:
        if len(chunks) > self.num_seqs:
            raise ValueError(f"chunks: {len(chunks)} sequences, the fixed shape holds {self.num_seqs}")
        n = self.tokens_per_seq
        filler = SequenceChunk([0] * n, 0, self.filler_slot, self.filler_slot, verify=n > 1)
        return [*chunks, *[filler] * (self.num_seqs - len(chunks))]


@dataclass
class ForwardBatch:
    """Tensors every layer of one forward shares. Tokens are packed sequence after sequence.

    Invariants: built from CPU-side lengths only (device tensors are only indexed, never read);
    `pad_index[b, t]` is the packed index of sequence b's t-th new token where `pad_valid[b, t]`;
    `pool_table[b, p]` is the pooled-key slot of sequence b's p-th complete pool after this forward
    (-1 past its last complete pool); `completed_pools` lists the pooled-key slots of pools whose
    last token is in this forward (in a fixed-shape batch, padded with the filler's pool).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its sequence
    token_seq: torch.Tensor  # [T] sequence index of each token
    token_rows: torch.Tensor  # [T] request-table row of each token
    new_slots: torch.Tensor  # [T] token-cache slot each token writes
    req_to_token: torch.Tensor  # [rows, max_len] the request table
    state_slots: torch.Tensor  # [B]
    pad_index: torch.Tensor  # [B, max_new]
    pad_valid: torch.Tensor  # [B, max_new]
    pool_table: torch.Tensor  # [B, max_pools]
    completed_pools: torch.Tensor  # [P]
    logits_index: torch.Tensor  # packed indices whose logits the forward returns
    extend_lens: list[int]
    prefix_lens: list[int]
    verify_seqs: list[int]  # indices of the verify chunks
    seq_rows: list[int]  # request-table row of each sequence (host copy)
    seq_slots: list[int]  # KDA state slot of each sequence (host copy)
    tokens: TokenCache
    states: StateCache
    # KDA layer -> what its verify kept for `commit` (the verified tokens' inputs and replay operands)
    kda_records: dict[int, VerifyCache] = field(default_factory=dict)
    features: torch.Tensor | None = None  # captured target features, when a forward asks for them
    # Set when every sequence has this many new tokens and is past position 0 (fixed-shape decode and
    # verify batches, device-built ones): the device tensors describe the step; the host lists above
    # may be a capture's placeholders, true for another step than the one replayed.
    uniform_width: int | None = None
    # sequence index -> its chunk's (tokens, snapshot id) points (`SequenceChunk.snapshots`), and the
    # state pool the snapshots go to; KDA layers advance such sequences in segments ending there
    snapshot_points: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    snapshot_pool: StateCache | None = None
    # Set in a prefill graph's batch (`PrefillGraphs`): each sequence's new tokens `[B]` (int64,
    # device); the rest of its `len(input_ids) // B` packed tokens are padding (`uniform_metadata`'s
    # `lengths`), and the host lists are placeholders
    padded_lens: torch.Tensor | None = None
    # and where its KDA layers leave prefix-cache snapshots (into `snapshot_pool`) inside the chunk:
    # `kda.ChunkSnapshots.chunk_ids`, `[chunks]` int64, -1 where none
    padded_snapshots: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        chunks: Sequence[SequenceChunk],
        req_to_token: torch.Tensor,
        tokens: TokenCache,
        states: StateCache,
        kpool: int,
        all_logits: bool = False,
        fixed: FixedShape | None = None,
    ) -> ForwardBatch:
        """Pack `chunks`; logits are returned for every token if `all_logits`, else for the last token
        of each chunk that samples. With `fixed`, the batch is padded to those shapes."""
        if fixed is not None:
            chunks = fixed.pad(chunks)
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        device = req_to_token.device
        extend = [len(c.token_ids) for c in chunks]
        prefix = [c.prefix_len for c in chunks]
        totals = [p + e for p, e in zip(prefix, extend, strict=True)]
        for i, (e, total) in enumerate(zip(extend, totals, strict=True)):
            if e == 0:
                raise ValueError(f"sequence {i} has no new tokens")
            if chunks[i].after_commit:
                raise ValueError(f"sequence {i} starts after a commit still in flight: a verify graph's")
            if total > req_to_token.shape[1]:
                raise ValueError(
                    f"sequence {i} reaches position {total}, the table holds {req_to_token.shape[1]}"
                )
        batch_size, max_new = len(chunks), max(extend)
        rows = torch.tensor([c.table_row for c in chunks])

        lens = torch.tensor(extend)
        starts = torch.cumsum(lens, 0) - lens
        token_seq = torch.repeat_interleave(torch.arange(batch_size), lens)
        packed = torch.arange(int(lens.sum()))
        positions = torch.tensor(prefix)[token_seq] + packed - starts[token_seq]
        steps = torch.arange(max_new)
        pad_valid = steps[None, :] < lens[:, None]
        pad_index = torch.where(pad_valid, starts[:, None] + steps[None, :], 0)

        pools_after = torch.tensor(totals) // kpool
        pool_width = int(pools_after.max())
        if fixed is not None and not pool_width <= fixed.pool_width <= req_to_token.shape[1] // kpool:
            raise ValueError(
                f"fixed.pool_width: {fixed.pool_width} pools, a sequence has {pool_width} and the "
                f"table holds {req_to_token.shape[1] // kpool}"
            )
        completed = [
            (c.table_row, p * kpool)
            for c, before, after in zip(chunks, prefix, totals, strict=True)
            for p in range(before // kpool, after // kpool)
        ]
        if fixed is not None:
            if len(completed) > fixed.num_completed:
                raise ValueError(
                    f"chunks: {len(completed)} pools complete, the fixed shape holds {fixed.num_completed}"
                )
            completed += [(fixed.filler_slot, 0)] * (fixed.num_completed - len(completed))
        done = torch.tensor(completed, dtype=torch.long).view(-1, 2)
        logits_index = packed if all_logits else torch.cat([
            torch.arange(start, start + n) if c.verify or c.score else torch.tensor([start + n - 1])
            for c, start, n in zip(chunks, starts.tolist(), extend, strict=True)
            if c.sample or c.verify or c.score
        ] or [torch.zeros(0, dtype=torch.long)])  # fmt: skip

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        token_rows = dev(rows[token_seq])
        positions_d = dev(positions)
        pool_ids = torch.arange(pool_width, device=device)
        pool_valid = pool_ids[None, :] < dev(pools_after)[:, None]
        table_pools = req_to_token[dev(rows)[:, None], pool_ids[None, :] * kpool].long() // kpool
        return cls(
            input_ids=dev(torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)),
            positions=positions_d,
            token_seq=dev(token_seq),
            token_rows=token_rows,
            new_slots=req_to_token[token_rows, positions_d].long(),
            req_to_token=req_to_token,
            state_slots=dev(torch.tensor([c.state_slot for c in chunks], dtype=torch.long)),
            pad_index=dev(pad_index),
            pad_valid=dev(pad_valid),
            pool_table=torch.where(pool_valid, table_pools, -1),
            completed_pools=req_to_token[dev(done[:, 0]), dev(done[:, 1])].long() // kpool,
            logits_index=dev(logits_index),
            extend_lens=extend,
            prefix_lens=prefix,
            verify_seqs=[i for i, c in enumerate(chunks) if c.verify],
            seq_rows=[c.table_row for c in chunks],
            seq_slots=[c.state_slot for c in chunks],
            tokens=tokens,
            states=states,
            uniform_width=None if fixed is None else fixed.tokens_per_seq,
            snapshot_points={i: sorted(c.snapshots) for i, c in enumerate(chunks) if c.snapshots},
        )

    @classmethod
    def uniform(
        cls,
        prefix: torch.Tensor,
        rows: torch.Tensor,
        width: int,
        req_to_token: torch.Tensor,
        tokens: TokenCache,
        states: StateCache,
        kpool: int,
    ) -> ForwardBatch:
        """`len(prefix)` sequences of `width` new tokens, sequence b at positions `prefix[b] ..
        prefix[b] + width - 1` of request-table row (and state slot) `rows[b]`; every tensor made on
        the device from those two (int64, device) and the table, nothing read back. Logits for every
        token; `input_ids` are zeros (for layers fed embeddings). The host lists are placeholders, so
        there are no verify chunks: the batch is for layers that read device tensors only (attention,
        MLP; not KDA verify). `pool_table` is as wide as the request table; every position must be
        backed."""
        b = prefix.shape[0]
        device = req_to_token.device
        meta = uniform_metadata(prefix, rows, width, req_to_token, kpool)
        packed = torch.arange(b * width, device=device)
        return cls(
            input_ids=torch.zeros(b * width, dtype=torch.long, device=device),
            token_seq=packed // width,
            req_to_token=req_to_token,
            pad_index=packed.view(b, width),
            pad_valid=torch.ones(b, width, dtype=torch.bool, device=device),
            logits_index=packed,
            extend_lens=[width] * b,
            prefix_lens=[0] * b,
            verify_seqs=[],
            seq_rows=[-1] * b,
            seq_slots=[-1] * b,
            tokens=tokens,
            states=states,
            uniform_width=width,
            **meta,
        )


def uniform_metadata(
    prefix: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
    kpool: int,
    filler_row: int | None = None,
    lengths: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """On the device, what `ForwardBatch.build` computes for sequences of `width` tokens at device
    prefix lengths `prefix [B]` in table rows `rows [B]`: `positions`, `token_rows`, `new_slots`,
    `state_slots`, `completed_pools` (`B · ceil(width / kpool)` entries) and a `pool_table` as wide as
    the table.

    `completed_pools` lists, per sequence, the pools its tokens may complete; a listed pool that does
    not complete is replaced by the first pool of `filler_row` (a row nobody owns: a fixed-shape
    batch's scratch slot) or, without one, by the sequence's pool at `prefix`, which is incomplete
    before this forward, is masked out of `pool_table` until some forward completes it, and is
    recompressed by that forward: whatever this one writes to its pooled slot is never read. (When
    that pool does complete here, both entries compute the same key from the same entries.)

    With `lengths [B]` (device, 1 <= lengths[b] <= width) sequence b has that many new tokens and the
    rest of its width is padding: a padding token takes the position of the sequence's last token and
    writes the first slot of `filler_row` (required), so that no sequence ever reads it; the pools
    follow the real lengths."""
    device = req_to_token.device
    steps = torch.arange(width, device=device)
    positions = prefix[:, None] + steps
    end = prefix + width if lengths is None else prefix + lengths
    pools_after = end // kpool
    candidates = prefix[:, None] // kpool + torch.arange(-(-width // kpool), device=device)
    completes = candidates < pools_after[:, None]
    if filler_row is None:
        pool_rows, candidates = rows[:, None], torch.where(completes, candidates, prefix[:, None] // kpool)
    else:
        pool_rows = torch.where(completes, rows[:, None], filler_row)
        candidates = torch.where(completes, candidates, 0)
    completed = req_to_token[pool_rows, candidates * kpool].long() // kpool
    columns = torch.arange(req_to_token.shape[1] // kpool, device=device)
    pool_slots = req_to_token[rows[:, None], columns[None, :] * kpool].long() // kpool
    if lengths is None:
        new_slots = req_to_token[rows[:, None], positions]
    else:
        if filler_row is None:
            raise ValueError("lengths: padding tokens write the filler row, and none was given")
        positions = torch.minimum(positions, end[:, None] - 1)
        real = steps[None, :] < lengths[:, None]
        new_slots = torch.where(real, req_to_token[rows[:, None], positions], req_to_token[filler_row, 0])
    return {
        "positions": positions.flatten(),
        # a copy: with one sequence an expanded flatten is a stride-0 view, and kernels index rows densely
        "token_rows": rows.repeat_interleave(width),
        "new_slots": new_slots.long().flatten(),
        "state_slots": rows,
        "completed_pools": completed.flatten(),
        "pool_table": torch.where(columns[None, :] < pools_after[:, None], pool_slots, -1),
    }
