"""The in-memory store of `/v1/responses` (`store: true`): each response as `GET /v1/responses/{id}`
returns it, and the conversation a later request's `previous_response_id` continues. Bounded by a
number of entries and an age: a put beyond `max_entries` evicts the oldest, and an entry older than
`max_age_s` is gone (it is dropped when any lookup or put finds it). Nothing survives a restart."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# `hylo serve --responses-store-size / --responses-store-age`
DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """A finished response (`response`, the JSON body) and its whole conversation: the input items
    of every response it continues, then its own input and output items, as input items (what a
    `previous_response_id` of it prepends)."""

    response: dict[str, Any]
    conversation: tuple[Any, ...]


class ResponseStore:
    """Safe to use from the event loop only (no lock): every route that touches it runs there."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1 or max_age_s <= 0:
            raise ValueError(
                f"the responses store needs at least one entry and a positive age "
                f"(got {max_entries} entries, {max_age_s} s)"
            )
        self.max_entries, self.max_age_s, self.clock = max_entries, max_age_s, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._expire()
        self._entries[response_id] = (self.clock(), stored)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response (now gone)."""
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        """Drop the entries older than `max_age_s`: the oldest are first, so stop at the first young one."""
        oldest_kept = self.clock() - self.max_age_s
        while self._entries:
            created, _ = next(iter(self._entries.values()))
            if created > oldest_kept:
                return
            self._entries.popitem(last=False)
