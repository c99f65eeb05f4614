"""The prefix cache's changes as vLLM KV events (hylo.server.kv_events.PageEvents), on the cache alone:
what joins the tree is announced once, in chains; what leaves it is withdrawn; a clear is one event.
(The wire and a router reading it: tests/test_server_routers.py.)"""

from __future__ import annotations

from hylo.memory.pages import FreeList, SharedPages
from hylo.memory.prefix_cache import PrefixCache
from hylo.server.kv_events import PageEvents

PAGE = 4


class Cache:
    """A prefix cache of PAGE-token pages (a snapshot at every page) with PageEvents listening."""

    def __init__(self):
        self.pages = SharedPages(32)
        self.tree = PrefixCache(self.pages, FreeList(8), PAGE, PAGE)
        self.events = PageEvents(PAGE, "CPU")
        self.tree.listener = self.events

    def prefill(self, tokens: list[int]) -> None:
        """What a request that computed `tokens` (whole pages) leaves in the tree once it finished."""
        pages = self.pages.alloc(len(tokens) // PAGE)
        self.tree.insert(tokens, pages, len(tokens), self.tree.alloc_snapshot())
        self.pages.unshare(pages)


def test_a_prefill_is_announced_as_one_chain_and_its_extension_under_its_last_page():
    cache = Cache()
    first = list(range(12))
    cache.prefill(first)
    (chain,) = cache.events.take()
    assert chain["type"] == "BlockStored" and chain["parent_block_hash"] is None
    assert chain["token_ids"] == first and chain["block_size"] == PAGE and chain["medium"] == "CPU"
    assert len(chain["block_hashes"]) == 3 and len(set(chain["block_hashes"])) == 3  # one event a chain

    cache.prefill([*first[:8], 100, 101, 102, 103])  # shares two pages: only the third joins
    (branch,) = cache.events.take()
    assert branch["parent_block_hash"] == chain["block_hashes"][1]
    assert branch["token_ids"] == [100, 101, 102, 103] and len(branch["block_hashes"]) == 1
    cache.prefill(first)  # all cached: nothing joins
    assert cache.events.take() == []


def test_a_blocks_hash_names_its_whole_prefix_on_any_server():
    one, other = Cache(), Cache()
    one.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    other.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    (a,), (b,) = one.events.take(), other.events.take()
    assert a["block_hashes"] == b["block_hashes"]
    other.prefill([9, 9, 9, 9, 5, 6, 7, 8])  # the same second page under another first page
    (c,) = other.events.take()
    assert not set(c["block_hashes"]) & set(a["block_hashes"])


def test_evicted_pages_are_withdrawn_and_a_clear_is_one_event():
    cache = Cache()
    cache.prefill(list(range(8)))
    cache.prefill([50, 51, 52, 53])
    stored = [h for event in cache.events.take() for h in event["block_hashes"]]
    assert cache.tree.evict_pages(2) == 2
    (removed,) = cache.events.take()  # two leaves, least recently used first: one event
    assert removed == {"type": "BlockRemoved", "block_hashes": removed["block_hashes"], "medium": "CPU"}
    assert len(removed["block_hashes"]) == 2 and set(removed["block_hashes"]) <= set(stored)
    cache.tree.clear()
    assert cache.events.take() == [{"type": "AllBlocksCleared"}]
    cache.prefill(list(range(8)))  # announced again after the clear, with the same hashes
    (again,) = cache.events.take()
    assert again["block_hashes"] == stored[:2]
