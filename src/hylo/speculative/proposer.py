"""The interface between the engine and a draft model, and what one target forward committed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hylo.forward_batch import ForwardBatch
from hylo.memory.specs import CacheSpec
from hylo.sampling import SamplingParams
from hylo.speculative.verify import VerifyShape


class DraftedSequence(Protocol):
    """What a host-side proposer reads of a sequence it drafts for (`HostCommit.request`; the engine's
    `Request` is one): its prompt, the output the host has read (the step's new tokens not appended
    yet), its sampling parameters and its request-table row, the row of its drafts."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    params: SamplingParams
    slot: int | None


@dataclass
class HostCommit:
    """One sequence's commit as the host knows it after the step's read: positions `start ..
    start + count - 1` of `request` are committed, their features at packed rows `offset ..
    offset + count - 1` of the forward; `new_tokens` are what the step adds to the output (empty for a
    prefill chunk that does not sample; the last of them is the next anchor)."""

    request: DraftedSequence
    start: int
    count: int
    offset: int
    new_tokens: list[int]


@dataclass
class StepCommit:
    """What one target forward committed, read by the proposer's `observe` and `propose`.

    Invariants: `counts[s]` (int32, device) is how many of sequence s's new tokens are now in the
    target's caches (every token of a plain chunk; the anchor and the accepted drafts of a verify
    chunk); `anchors[s]` (int64, device) is the token sequence s picked after them where it samples
    (unspecified elsewhere); `sampling` lists the sequences that sampled: exactly those draft next.
    `features` are the forward's captured target features of every packed token (the proposer's
    `capture_layers`: `ForwardOutput.features`), None when it captured none. `host` is None while
    the step is still on the device (inside a captured graph) and the host's copy once the step's
    tokens have been read.
    """

    counts: torch.Tensor
    anchors: torch.Tensor
    sampling: torch.Tensor  # [S'] int64 device: indices of the sampling sequences
    features: torch.Tensor | None = None
    host: list[HostCommit] | None = None


@dataclass
class ProposerCaches:
    """What the engine hands a proposer when it builds it: the request table its per-token pools are
    indexed by (`req_to_token [rows, max_len]`), those pools (`pools[i]` allocated from the `i`-th of
    its `ProposerBuild.specs` with one entry per token-cache slot) and the draft rows
    (`drafts [rows, verify_shape.drafts]`, zeros)."""

    req_to_token: torch.Tensor
    drafts: torch.Tensor
    pools: list[Any] = field(default_factory=list)


@dataclass
class ProposerBuild:
    """A proposer whose weights are loaded and whose caches are not allocated yet: `specs` are the
    per-token pools it needs (the memory plan sums them with the target's), `build` makes the proposer
    around them once the plan has allocated them; a prefix-cache snapshot keeps `snapshot_feature_dim`
    target features for it (`Proposer.needs_last_features`)."""

    specs: list[CacheSpec]
    verify_shape: VerifyShape
    build: Callable[[ProposerCaches], Proposer]
    snapshot_feature_dim: int = 0

    @classmethod
    def of(cls, proposer: Proposer) -> ProposerBuild:
        """A proposer made before the engine, with no caches: it only takes the draft rows."""

        if proposer.needs_last_features:
            raise ValueError("proposer: one that resumes from snapshot features is built by its own load")

        def build(caches: ProposerCaches) -> Proposer:
            proposer.use_drafts(caches.drafts)
            return proposer

        return cls([], proposer.verify_shape, build)


class Proposer(ABC):
    """Drafts up to `verify_shape.drafts` tokens per decoding request into `drafts`, for verify
    blocks of `verify_shape.block` tokens (the anchor and its drafts).

    Drafts are request state: `drafts[row]` (device, `[request-table rows, verify_shape.drafts]`) holds
    the drafts following the anchor of the request in table row `row`, written at the end of the step
    that picked that anchor and read by the next step's verify; they never visit the host.

    Invariants: `observe` sees every token the target commits, in order, with the features of
    `capture_layers` in `StepCommit.features` (the mean of the residual streams after each of those
    target layers, concatenated), so a proposer's own caches follow the target's committed length exactly;
    `propose` then drafts for every sampling sequence of that batch. With `needs_host` the runner calls
    both after the step's read, with `StepCommit.host` set; without it, before the read, from device
    tensors alone (so both may run inside a captured CUDA graph).
    """

    verify_shape: VerifyShape
    capture_layers: tuple[int, ...] = ()
    needs_host: bool = True
    # the observe of a chunk from position S writes the proposer's entry at S - 1 (from the features
    # of S - 1, `resume`): a request resuming from a prefix-cache snapshot at S needs those features
    # and a private copy of the page holding S - 1
    needs_last_features: bool = False
    # `observe` and `propose` take a padded batch (`forward_batch.Padded`: a prefill graph's),
    # reading its device tensors and `StepCommit.counts` alone
    observes_padded: bool = False
    drafts: torch.Tensor

    def use_drafts(self, drafts: torch.Tensor) -> None:
        """Take the engine's draft rows (`[request-table rows, verify_shape.drafts]`,
        `ProposerCaches.drafts`): for a proposer made before the engine (one with no caches of its own,
        `ProposerBuild.of`)."""
        self.drafts = drafts

    def copy_tokens(self, src: int, dst: int, n: int) -> None:  # noqa: B027 (optional hook)
        """Copy the per-token caches of token slots `src .. src + n - 1` to `dst ..` (whole pages)."""

    def resume(self, row: int, features: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """The request in table row `row` resumes from a prefix snapshot whose last token had these
        captured target features (called only with `needs_last_features`)."""

    def observe(self, batch: ForwardBatch, commit: StepCommit) -> None:  # noqa: B027 (optional hook)
        """Learn of committed tokens (default: nothing to learn)."""

    @abstractmethod
    def propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """Write `drafts[row]` for the table row of every sampling sequence of `batch`."""

    def observe_and_propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """`observe`, then `propose`: for a step that drafts (a proposer may fuse the two)."""
        self.observe(batch, commit)
        self.propose(batch, commit)


def write_drafts(drafts: torch.Tensor, rows: Sequence[int], proposals: Sequence[Sequence[int]]) -> None:
    """Host-made proposals into the draft rows (for host-side proposers: one upload per step)."""
    width = drafts.shape[1]
    if not rows:
        return
    padded = [list(p[:width]) + [0] * (width - len(p[:width])) for p in proposals]
    drafts[torch.tensor(list(rows), device=drafts.device)] = torch.tensor(padded, device=drafts.device)
