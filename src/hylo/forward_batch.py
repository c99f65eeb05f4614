"""Metadata of one model forward over a batch of sequences: built once on the CPU (`ForwardBatch.build`),
or on the device from device lengths alone (`ForwardBatch.uniform`, what a CUDA graph builds inside
its capture). A batch says how its tokens sit (`layout`: `Packed`, `Uniform` or `Padded`) and carries
the plan its KDA layers walk it by (`kda`, `hylo.kda_plan`); what a forward produces (logits,
features, KDA verify records) is the model's return value, never written into the batch."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hylo.host_copy import to_device
from hylo.kda_plan import KDAPlan
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.ops import batch_metadata
from hylo.ops.batch_metadata import uniform_metadata
from hylo.ops.kda import CHUNK_TOKENS


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


@dataclass(frozen=True)
class Packed:
    """Sequences of any lengths packed one after another (`ForwardBatch.build` without a fixed shape):
    the host lists are the step's."""


@dataclass(frozen=True)
class Uniform:
    """Every sequence has `width` new tokens and is past position 0 (fixed-shape decode and verify
    batches, device-built ones: `ForwardBatch.build` with a `FixedShape`, `ForwardBatch.uniform`):
    the device tensors describe the step; the host lists may be a capture's placeholders, true for
    another step than the one replayed."""

    width: int


@dataclass(frozen=True)
class Padded:
    """One sequence of `lengths [1]` (int64, device) new tokens, the rest of its `len(input_ids)`
    packed tokens padding (`uniform_metadata`'s `lengths`: a prefill graph's batch, `PrefillGraphs`);
    its KDA layers leave prefix-cache snapshots inside the chunk at `chunk_snapshots`
    (`kda.ChunkSnapshots.chunk_ids`, `[chunks]` int64, -1 where none). The padding writes the first
    slot of request-table row `filler_row`, a row nobody owns (the scratch slot), the same for every
    step, so that a reader may build a padded batch of its own over the same tokens (a proposer's).
    The host lists are placeholders."""

    lengths: torch.Tensor
    chunk_snapshots: torch.Tensor
    filler_row: int


# How a batch's tokens sit: what a reader of its host lists or of its shapes branches on.
TokenLayout = Packed | Uniform | Padded


@dataclass
class ForwardBatch:
    """Tensors every layer of one forward shares. Tokens are packed sequence after sequence, as
    `layout` says (`Packed`, `Uniform`, `Padded`).

    Invariants: built from CPU-side lengths only (device tensors are only indexed, never read);
    `pad_index[b, t]` is the packed index of sequence b's t-th new token where `pad_valid[b, t]`;
    `pool_table[b, p]` is the pooled-key slot of sequence b's p-th complete pool after this forward
    (-1 past its last complete pool); `completed_pools` lists the pooled-key slots of pools whose
    last token is in this forward (in a fixed-shape batch, padded with the filler's pool); `kda` is
    made from the batch's own lists and tensors at construction (a `dataclasses.replace` makes a
    new one).
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
    layout: TokenLayout
    # sequence index -> its chunk's (tokens, snapshot id) points (`SequenceChunk.snapshots`), and the
    # state pool the KDA layers copy those snapshots into (`KDAPlan.chunk_snapshots`, `segment_rounds`)
    snapshot_points: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    snapshot_pool: StateCache | None = None
    # how the KDA layers walk the sequences (offsets, verify blocks, snapshot rounds)
    kda: KDAPlan = field(init=False, repr=False)

    def __post_init__(self) -> None:
        padded = self.layout if isinstance(self.layout, Padded) else None
        self.kda = KDAPlan(
            self.extend_lens, self.verify_seqs, self.seq_slots, self.state_slots, self.snapshot_points,
            padded_lengths=None if padded is None else padded.lengths,
            padded_chunk_ids=None if padded is None else padded.chunk_snapshots,
        )  # fmt: skip

    def metadata_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors `uniform_metadata` computes, by name: a fixed-shape batch's are rewritten in place
        each step (`uniform_metadata(..., out=batch.metadata_tensors())`)."""
        return {name: getattr(self, name) for name in batch_metadata.FIELDS}

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
        snapshot_pool: StateCache | None = None,
    ) -> ForwardBatch:
        """Pack `chunks` (`Packed`); logits are returned for every token if `all_logits`, else for the
        last token of each chunk that samples. With `fixed`, the batch is padded to those shapes
        (`Uniform`). `snapshot_pool`: where the chunks' prefix-cache snapshots go (needed when a chunk
        has some)."""
        if fixed is not None:
            chunks = fixed.pad(chunks)
        _check_chunks(chunks, req_to_token.shape[1])
        device = req_to_token.device
        host = _HostPacking.of(chunks, kpool, all_logits)
        pool_width = int(host.pools_after.max())
        if fixed is not None and not pool_width <= fixed.pool_width <= req_to_token.shape[1] // kpool:
            raise ValueError(
                f"fixed.pool_width: {fixed.pool_width} pools, a sequence has {pool_width} and the "
                f"table holds {req_to_token.shape[1] // kpool}"
            )
        done = _completed_pools(chunks, kpool, fixed)
        dev = functools.partial(to_device, device=device)  # pinned staging, copies that do not block the host
        rows = torch.tensor([c.table_row for c in chunks])
        token_rows, positions = dev(rows[host.token_seq]), dev(host.positions)
        pool_ids = torch.arange(pool_width, device=device)
        pool_valid = pool_ids[None, :] < dev(host.pools_after)[:, None]
        table_pools = req_to_token[dev(rows)[:, None], pool_ids[None, :] * kpool].long() // kpool
        return cls(
            input_ids=dev(_packed_token_ids(chunks)),
            positions=positions,
            token_seq=dev(host.token_seq),
            token_rows=token_rows,
            new_slots=req_to_token[token_rows, positions].long(),
            req_to_token=req_to_token,
            state_slots=dev(torch.tensor([c.state_slot for c in chunks], dtype=torch.long)),
            pad_index=dev(host.pad_index),
            pad_valid=dev(host.pad_valid),
            pool_table=torch.where(pool_valid, table_pools, -1),
            completed_pools=req_to_token[dev(done[:, 0]), dev(done[:, 1])].long() // kpool,
            logits_index=dev(host.logits_index),
            extend_lens=host.extend,
            prefix_lens=[c.prefix_len for c in chunks],
            verify_seqs=[i for i, c in enumerate(chunks) if c.verify],
            seq_rows=[c.table_row for c in chunks],
            seq_slots=[c.state_slot for c in chunks],
            tokens=tokens,
            states=states,
            layout=Packed() if fixed is None else Uniform(fixed.tokens_per_seq),
            snapshot_points={i: sorted(c.snapshots) for i, c in enumerate(chunks) if c.snapshots},
            snapshot_pool=snapshot_pool,
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
        lengths: torch.Tensor | None = None,
        filler_row: int | None = None,
    ) -> ForwardBatch:
        """`len(prefix)` sequences of `width` new tokens (`Uniform`), sequence b at positions
        `prefix[b] .. prefix[b] + width - 1` of request-table row (and state slot) `rows[b]`; every
        tensor made on the device from those two (int64, device) and the table, nothing read back.
        Logits for every token; `input_ids` are zeros (for layers fed embeddings). The host lists are
        placeholders, so there are no verify chunks: the batch is for layers that read device tensors
        only (attention, MLP; not KDA verify). `pool_table` is as wide as the request table; every
        position must be backed.

        With `lengths [1]` (int64, device, 1 <= lengths[0] <= width) and `filler_row`, one sequence of
        `lengths[0]` new tokens padded to `width` (`Padded`, no prefix-cache snapshot): its padding
        writes `filler_row`'s first slot (`uniform_metadata`)."""
        b = prefix.shape[0]
        const = _uniform_constants(b, width, req_to_token.device)
        meta = uniform_metadata(prefix, rows, width, req_to_token, kpool, filler_row, lengths)
        layout: TokenLayout = Uniform(width)
        if lengths is not None:
            layout = Padded(lengths, const.no_snapshots, filler_row)
        return cls(
            input_ids=const.input_ids,
            token_seq=const.token_seq,
            req_to_token=req_to_token,
            pad_index=const.packed.view(b, width),
            pad_valid=const.pad_valid,
            logits_index=const.packed,
            extend_lens=[width] * b,
            prefix_lens=[0] * b,
            verify_seqs=[],
            seq_rows=[-1] * b,
            seq_slots=[-1] * b,
            tokens=tokens,
            states=states,
            layout=layout,
            **meta,
        )


@dataclass(frozen=True)
class _UniformConstants:
    """The tensors of a uniform batch that depend on its shape alone (`ForwardBatch.uniform`)."""

    input_ids: torch.Tensor  # [B·width] zeros
    packed: torch.Tensor  # [B·width] 0 .. B·width - 1
    token_seq: torch.Tensor  # [B·width] packed // width
    pad_valid: torch.Tensor  # [B, width] True
    no_snapshots: torch.Tensor  # [ceil(width / CHUNK_TOKENS)] -1


# (B, width, device) -> its constants: a handful of small shapes per engine (graph buckets and widths)
_uniform_constants_made: dict[tuple[int, int, torch.device], _UniformConstants] = {}


def _uniform_constants(b: int, width: int, device: torch.device) -> _UniformConstants:
    """The constants of a (B, width) uniform batch, made once per shape and device (an MTP verify
    step builds three uniform batches: 12 launches a step fewer). Nothing writes them: a uniform
    batch's layers read no `input_ids` and its index tensors only. Inside a CUDA graph's capture a
    missing shape is made for that batch alone, not kept: its kernels would only run at replay. The
    graphs' warm-up runs every shape eagerly before capturing it, so captures find theirs made."""
    key = (b, width, device)
    made = _uniform_constants_made.get(key)
    if made is not None:
        return made
    packed = torch.arange(b * width, device=device)
    made = _UniformConstants(
        input_ids=torch.zeros(b * width, dtype=torch.long, device=device),
        packed=packed,
        token_seq=packed // width,
        pad_valid=torch.ones(b, width, dtype=torch.bool, device=device),
        no_snapshots=torch.full((-(-width // CHUNK_TOKENS),), -1, dtype=torch.long, device=device),
    )
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _uniform_constants_made[key] = made
    return made


def _packed_token_ids(chunks: Sequence[SequenceChunk]) -> torch.Tensor:
    """The chunks' tokens one after another, int64 on the host. Each list is packed by `array`'s C
    loop (a 13K-token prompt in ~0.2 ms, against ~1 ms through a Python comprehension)."""
    ids = array("q")
    for c in chunks:
        ids += array("q", c.token_ids)
    return torch.frombuffer(ids, dtype=torch.long)


def _check_chunks(chunks: Sequence[SequenceChunk], table_len: int) -> None:
    """Raise unless every chunk has new tokens, fits a request-table row of `table_len` positions and
    starts where the host knows it (an `after_commit` chunk is a verify graph's)."""
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    for i, c in enumerate(chunks):
        total = c.prefix_len + len(c.token_ids)
        if len(c.token_ids) == 0:
            raise ValueError(f"sequence {i} has no new tokens")
        if c.after_commit:
            raise ValueError(f"sequence {i} starts after a commit still in flight: a verify graph's")
        if total > table_len:
            raise ValueError(f"sequence {i} reaches position {total}, the table holds {table_len}")


@dataclass(frozen=True)
class _HostPacking:
    """Where the chunks' tokens sit, computed on the host (`ForwardBatch.build` uploads it)."""

    extend: list[int]  # new tokens of each chunk
    token_seq: torch.Tensor  # [T] chunk of each packed token
    positions: torch.Tensor  # [T]
    pad_index: torch.Tensor  # [B, max_new]
    pad_valid: torch.Tensor  # [B, max_new]
    pools_after: torch.Tensor  # [B] complete pools of each sequence after the forward
    logits_index: torch.Tensor

    @classmethod
    def of(cls, chunks: Sequence[SequenceChunk], kpool: int, all_logits: bool) -> _HostPacking:
        extend = [len(c.token_ids) for c in chunks]
        prefix = torch.tensor([c.prefix_len for c in chunks])
        lens = torch.tensor(extend)
        starts = torch.cumsum(lens, 0) - lens
        token_seq = torch.repeat_interleave(torch.arange(len(chunks)), lens)
        packed = torch.arange(int(lens.sum()))
        steps = torch.arange(max(extend))
        pad_valid = steps[None, :] < lens[:, None]
        logits_index = packed if all_logits else torch.cat([
            torch.arange(start, start + n) if c.verify or c.score else torch.tensor([start + n - 1])
            for c, start, n in zip(chunks, starts.tolist(), extend, strict=True)
            if c.sample or c.verify or c.score
        ] or [torch.zeros(0, dtype=torch.long)])  # fmt: skip
        return cls(
            extend=extend,
            token_seq=token_seq,
            positions=prefix[token_seq] + packed - starts[token_seq],
            pad_index=torch.where(pad_valid, starts[:, None] + steps[None, :], 0),
            pad_valid=pad_valid,
            pools_after=(prefix + lens) // kpool,
            logits_index=logits_index,
        )


def _completed_pools(chunks: Sequence[SequenceChunk], kpool: int, fixed: FixedShape | None) -> torch.Tensor:
    """`[P, 2]` int64 (host): (request-table row, position) of the first token of each pool whose last token
    is in `chunks`, padded to `fixed.num_completed` rows with the filler slot's first pool. Made by a few
    tensor ops whatever the pool count (a 13K-token prompt completes 3328 pools of 4 tokens: 5.8 ms on the
    CPU machine as a Python list of pairs, 0.1 ms so)."""
    first = torch.tensor([c.prefix_len // kpool for c in chunks])
    counts = torch.tensor([(c.prefix_len + len(c.token_ids)) // kpool for c in chunks]) - first
    total = int(counts.sum())
    offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rows = torch.repeat_interleave(torch.tensor([c.table_row for c in chunks]), counts)
    completed = torch.stack((rows, (torch.repeat_interleave(first, counts) + offsets) * kpool), 1)
    if fixed is None:
        return completed
    if total > fixed.num_completed:
        raise ValueError(f"chunks: {total} pools complete, the fixed shape holds {fixed.num_completed}")
    filler = torch.tensor([[fixed.filler_slot, 0]]).expand(fixed.num_completed - total, 2)
    return torch.cat((completed, filler))
