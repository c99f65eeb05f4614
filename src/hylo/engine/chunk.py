"""A scheduled chunk: one request's share of a step, as the scheduler makes it and everything after
the scheduler (the route, the runner, the picks, the draft driver) reads it. Frozen: a step's chunks
change only where the scheduler's ledger cuts a block launched ahead (`InFlightLedger.cut`)."""

from __future__ import annotations

from dataclasses import dataclass

from hylo.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` of the request's uncomputed tokens; a `verify` chunk instead feeds the anchor and
    its first `num_drafts` drafts (which the proposer keeps on the device; none for a decoding
    request without a draft budget in a step where others verify: it verifies a block of one token)."""

    request: Request
    num_tokens: int
    verify: bool = False
    # prefix-cache snapshots the chunk leaves: (position, snapshot id), the state after position - 1
    snapshots: tuple[tuple[int, int], ...] = ()

    @property
    def num_drafts(self) -> int:
        """The drafts a verify chunk feeds after its anchor (none for any other chunk)."""
        return self.num_tokens - 1 if self.verify else 0

    @property
    def verifies_drafts(self) -> bool:
        """A verify chunk with drafts (a block of one token verifies nothing: it decodes)."""
        return self.verify and self.num_tokens > 1

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last uncomputed token, so the target picks what follows."""
        return self.verify or self.num_tokens == self.request.remaining
