"""Token pages, request slots and the request-to-token table."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hylo.host_copy import to_device


class FreeList:
    """Hands out integer ids in `[0, size)`; an id is owned by at most one holder until freed."""

    def __init__(self, size: int):
        self.size = size
        self._free = list(range(size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` ids, lowest first, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        return taken

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(sorted(ids, reverse=True))


class SharedPages(FreeList):
    """Token pages counted by reference (`refs`): `alloc` hands pages out with one reference each,
    `share` adds one, `unshare` drops one and frees the pages nobody references any more. A running
    request holds one reference on every page of its table row, the prefix cache one on every page it
    keeps."""

    def __init__(self, size: int):
        super().__init__(size)
        self.refs = [0] * size

    def alloc(self, n: int) -> list[int] | None:
        taken = super().alloc(n)
        for p in taken or ():
            self.refs[p] = 1
        return taken

    def share(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def unshare(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; pages nobody references any more are free."""
        freed = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                freed.append(p)
        self.free(freed)


class RequestTable:
    """`req_to_token[row, position]` = token-cache slot of that position of the request in `row`.

    Positions are backed by pages of `page_size` slots (page p holds slots `p·page_size ..`), so every
    aligned run of `page_size` positions maps to an aligned run of slots: with `page_size` a multiple
    of the indexer's pool size, every k-pool sits in one aligned run, as `TokenCache` requires.
    Entries past a request's pages are stale and never read.
    """

    def __init__(self, rows: int, max_len: int, page_size: int, device: torch.device | str):
        self.page_size = page_size
        self.max_len = -(-max_len // page_size) * page_size
        self.table = torch.zeros(rows, self.max_len, dtype=torch.int32, device=device)

    def assign(self, row: int, first_page_index: int, pages: Sequence[int]) -> None:
        """Back positions `first_page_index·page_size ..` of `row` with `pages`."""
        offsets = torch.arange(self.page_size, dtype=torch.int32)
        slots = (torch.tensor(pages, dtype=torch.int32)[:, None] * self.page_size + offsets).flatten()
        start = first_page_index * self.page_size
        # from pinned memory: a pageable upload would wait for the steps in flight
        self.table[row, start : start + slots.numel()] = to_device(slots, self.table.device)
