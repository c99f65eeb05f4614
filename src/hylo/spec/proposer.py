"""The interface between the engine and a draft model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.engine.request import Request
from hylo.forward_batch import ForwardBatch


@dataclass
class Committed:
    """Tokens of one sequence the target has just committed to its caches: positions
    `start .. start + count - 1`, whose features sit at packed rows `offset .. offset + count - 1`
    of the forward that computed them."""

    request: Request
    start: int
    count: int
    offset: int


class Proposer(ABC):
    """Drafts up to `num_draft_tokens` tokens per decoding request.

    Invariants: `propose` is called once per verify step, with the requests whose last committed
    token is their anchor (the one sampled token not yet fed to the target); `observe` sees every
    token the target commits, in order, with the features of `capture_layers` (the mean of the
    residual streams after each of those target layers, concatenated), so a proposer's own caches
    can follow the target's committed length exactly.
    """

    num_draft_tokens: int
    capture_layers: tuple[int, ...] = ()

    def bytes_per_token(self) -> float:
        """Cache bytes the proposer keeps per token slot (added to the target's per-token cost)."""
        return 0.0

    def attach(self, num_token_slots: int, req_to_token: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Allocate per-token caches indexed like the target's token cache."""

    @abstractmethod
    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        """At most `budgets[i]` draft tokens to follow the anchor of `requests[i]`."""

    def observe(  # noqa: B027 (optional hook)
        self, batch: ForwardBatch, features: torch.Tensor | None, committed: Sequence[Committed]
    ) -> None:
        """Learn of committed tokens (default: nothing to learn)."""
