"""This rank's place in tensor and expert parallelism, and the collectives the layers call.

Glossary:
- rank / size: this process's index among the `size` ranks that split every layer (tensor parallel,
  TP). Rank 0 also talks to clients (`hylo.parallel.control`).
- ep_size: how the routed experts are split. `ep_size == size`: by expert (rank r holds experts
  `[r·E/size, (r+1)·E/size)`, every rank routes every token and computes only its experts' pairs);
  `ep_size == 1`: by tensor (every rank holds every expert's slice of the intermediate dimension).
- replicated: a tensor every rank holds whole (norms, router, mHC, indexer, the MLA latent cache).
- column / row parallel: a projection split along its output (each rank computes its heads or
  intermediate slice) / its input (each rank's partial sum, completed by `all_reduce`).
- sequence parallel: in a step of at least `sequence_parallel_tokens` tokens the residual streams stay
  split by token (`TokenShards`): a block's partial sums are completed by `reduce_scatter_rows` (each
  rank gets its tokens' sums) and its input is made whole by `all_gather_rows`, so the replicated work
  between blocks (mHC, norms) runs on 1/size of the tokens; the bytes moved equal the all-reduce's.
  The sparse attention core goes by token too (`heads_to_tokens` / `tokens_to_heads`, two all-to-alls):
  a token's gathered latent rows then serve all of its heads on one rank instead of size ranks' shares.

Invariant: every collective returns the same bits on every rank (an all-reduce's sum is computed
once per element and sent to all), so replicated computations stay equal across ranks and every rank
samples the same tokens from the same logits with the same seeds. The one exception is a rank built
with `StandInCollectives` (`hylo.distributed.rank_engine`: one rank measured alone on one device),
whose collectives are recorded and not run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hylo.config import ModelConfig


@dataclass(frozen=True)
class CollectiveCall:
    """One device collective as a rank issues it: `kind` (all_reduce, all_gather, reduce_scatter,
    all_to_all), the shape and dtype of the rank's input, and the bytes of that input."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(eq=False)
class StandInCollectives:
    """A local stand-in for the device collectives of one rank measured alone (no other rank exists):
    an all-reduce leaves the rank's partial sum as it is, an all-gather writes the rank's part into
    every rank's place (one copy: the output has the real shape and bytes), a reduce-scatter keeps the
    rank's rows of its partial sum, an all-to-all receives the rank's own chunk from every rank. Each
    call is appended to `calls` when it is issued; in a CUDA graph that is once, at capture. The results
    are not the real engine's, so a rank built on it serves timings, never tokens anyone reads."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def record(self, kind: str, x: torch.Tensor) -> None:
        self.calls.append(CollectiveCall(kind, tuple(x.shape), x.dtype))


@dataclass(frozen=True)
class TokenShards:
    """A step's `tokens` rows split over `size` ranks: each holds `local = ceil(tokens / size)` rows,
    rank r rows `[r·local, (r+1)·local)` of the tokens padded to `size·local` (padding rows: zeros going
    in, dropped coming out, never mixed into a real row: every op between the collectives is by row)."""

    tokens: int
    size: int
    rank: int

    @property
    def local(self) -> int:
        return -(-self.tokens // self.size)

    @property
    def padded(self) -> int:
        return self.local * self.size

    @property
    def mine(self) -> range:
        """This rank's real tokens: `[r·local, (r+1)·local)` cut at `tokens` (empty on a rank that
        holds padding alone)."""
        lo = min(self.rank * self.local, self.tokens)
        return range(lo, min(lo + self.local, self.tokens))

    def take(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """This rank's rows of `x [tokens, ...]` (replicated on every rank), padded with `fill`:
        `[local, ...]`."""
        mine = self.mine
        return self.pad_local(x[mine.start : mine.stop], fill)

    def pad_local(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """This rank's real rows `x [len(mine), ...]` padded with `fill` to `[local, ...]`."""
        return _rows_to(x, self.local, fill)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`x [tokens, ...]` with zero rows up to `padded`."""
        return _rows_to(x, self.padded, 0)


def _rows_to(x: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """`x` with rows of `fill` appended up to `rows` (x itself when it has them)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)])


@dataclass(frozen=True)
class Parallel:
    """`group` is the process group of the device collectives (NCCL on GPUs, gloo on CPUs); None for
    one rank, or for a rank that only builds shapes (`benchmarks/sizing.py`, meta tensors).
    `stand_in`: the collectives are recorded by it instead of run (`StandInCollectives`).
    `sequence_parallel_tokens`: the fewest tokens of a step whose streams are split by token (0: never;
    `EngineConfig.sequence_parallel_tokens`)."""

    rank: int = 0
    size: int = 1
    ep_size: int = 1
    group: dist.ProcessGroup | None = None
    stand_in: StandInCollectives | None = field(default=None, compare=False)
    sequence_parallel_tokens: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} of tp_size {self.size}: need 0 <= rank < tp_size")
        if self.ep_size not in (1, self.size):
            raise ValueError(
                f"ep_size must be 1 (experts split by tensor) or tp_size ({self.size}: split by expert), "
                f"got {self.ep_size}"
            )

    @property
    def experts_by_expert(self) -> bool:
        return self.size > 1 and self.ep_size == self.size

    def part(self, n: int, what: str) -> int:
        """This rank's share of `n` (`what`: the config field, for the error when it does not divide)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be divisible by tp_size ({self.size})")
        return n // self.size

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's `[lo, hi)` of `n` items split evenly."""
        local = self.part(n, what)
        return self.rank * local, (self.rank + 1) * local

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """This rank's vocabulary rows: `ceil(vocab / size)` each, the last rank's padded past `vocab`
        (no token id reaches a padding row, and its logits are cut before anyone reads them)."""
        local = -(-vocab // self.size)
        if (self.size - 1) * local >= vocab:
            raise ValueError(f"vocab_size ({vocab}) leaves the last of tp_size ({self.size}) ranks no rows")
        return self.rank * local, (self.rank + 1) * local

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """`config` with this rank's head counts: what its per-head caches (KDA states) are sized by."""
        if self.size == 1:
            return config
        return dataclasses.replace(
            config,
            linear_num_heads=self.part(config.linear_num_heads, "linear_num_heads"),
            num_attention_heads=self.part(config.num_attention_heads, "num_attention_heads"),
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (nothing for one rank); returns it."""
        if self.size == 1:
            return x
        if self.stand_in is not None:
            self.stand_in.record("all_reduce", x)
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def complete(self, partial: torch.Tensor, shards: TokenShards | None) -> torch.Tensor:
        """A row-parallel block's `partial [tokens, ...]` summed over the ranks: every token's
        (all-reduce), or with `shards` this rank's tokens' (reduce-scatter)."""
        return self.all_reduce(partial) if shards is None else self.reduce_scatter_rows(partial, shards)

    def whole(self, x: torch.Tensor, shards: TokenShards | None) -> torch.Tensor:
        """`x` of every token: as it is, or with `shards` this rank's tokens' rows gathered."""
        return x if shards is None else self.all_gather_rows(x, shards)

    def token_shards(self, tokens: int) -> TokenShards | None:
        """How a step of `tokens` tokens splits its streams, or None (kept whole: one rank, sequence
        parallelism off, or a step too small for two collectives to beat one)."""
        if self.size == 1 or not self.sequence_parallel_tokens or tokens < self.sequence_parallel_tokens:
            return None
        return TokenShards(tokens, self.size, self.rank)

    def reduce_scatter_rows(self, x: torch.Tensor, shards: TokenShards) -> torch.Tensor:
        """This rank's rows of the sum over the ranks of `x [tokens, ...]` (each rank's partial sum):
        `[local, ...]`, padding rows zero."""
        x = shards.pad(x).contiguous()
        if self.stand_in is not None:
            self.stand_in.record("reduce_scatter", x)
            return shards.take(x).clone()
        if x.is_cuda:  # one launch, capturable in a CUDA graph
            out = x.new_empty(shards.local, *x.shape[1:])
            dist.reduce_scatter_tensor(out, x, group=self.group)
            return out
        dist.all_reduce(x, group=self.group)  # gloo has no reduce-scatter: the sum, then this rank's rows
        return shards.take(x).clone()

    def all_gather_rows(self, x: torch.Tensor, shards: TokenShards) -> torch.Tensor:
        """Every rank's rows `x [local, ...]` in rank order, the padding cut: `[tokens, ...]`."""
        x = x.contiguous()
        parts = x.new_empty(shards.padded, *x.shape[1:])
        if self.stand_in is not None:
            self.stand_in.record("all_gather", x)
            parts.view(self.size, *x.shape).copy_(x.expand(self.size, *x.shape))
        elif x.is_cuda:
            dist.all_gather_into_tensor(parts, x, group=self.group)
        else:
            dist.all_gather(list(parts.view(self.size, *x.shape).unbind(0)), x, group=self.group)
        return parts[: shards.tokens]

    def heads_to_tokens(self, x: torch.Tensor, shards: TokenShards) -> torch.Tensor:
        """`x [tokens, h, ...]` (every token, this rank's h heads) to `[local, size·h, ...]` (this rank's
        tokens, every rank's heads in rank order: the global head order): one all-to-all."""
        chunks = shards.pad(x).contiguous().view(self.size, shards.local, *x.shape[1:])
        mine = self._all_to_all(chunks)  # [i] = my tokens, rank i's heads
        return mine.transpose(0, 1).reshape(shards.local, self.size * x.shape[1], *x.shape[2:])

    def tokens_to_heads(self, x: torch.Tensor, shards: TokenShards) -> torch.Tensor:
        """The inverse of `heads_to_tokens`: `[local, size·h, ...]` to `[tokens, h, ...]`."""
        h = x.shape[1] // self.size
        chunks = x.view(shards.local, self.size, h, *x.shape[2:]).transpose(0, 1).contiguous()
        theirs = self._all_to_all(chunks)  # [i] = rank i's tokens, my heads
        return theirs.view(shards.padded, h, *x.shape[2:])[: shards.tokens]

    def _all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunk i of `chunks [size, ...]` sent to rank i; returns the chunks received, by sender."""
        if self.stand_in is not None:
            self.stand_in.record("all_to_all", chunks)
            return chunks[self.rank].expand_as(chunks).clone()
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x [..., n]` side by side: `[..., size·n]`, rank 0's columns first."""
        if self.size == 1:
            return x
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        parts = torch.empty((self.size, *flat.shape), dtype=x.dtype, device=x.device)
        if self.stand_in is not None:
            self.stand_in.record("all_gather", flat)
            parts.copy_(flat.expand_as(parts))
        elif x.is_cuda:  # one launch, capturable in a CUDA graph
            dist.all_gather_into_tensor(parts.view(-1, flat.shape[1]), flat, group=self.group)
        else:
            dist.all_gather(list(parts.unbind(0)), flat, group=self.group)
        return parts.permute(1, 0, 2).reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE = Parallel()
