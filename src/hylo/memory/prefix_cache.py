"""Prefix cache: the pages of computed prompts in a tree of whole pages, with snapshots of every KDA
layer's state at page boundaries, so that a later request with the same leading tokens starts there.

Why whole pages and not a token-level radix tree: a hybrid model can resume a sequence only where a
snapshot of its KDA states exists, and a snapshot is only worth taking where the attention caches
before it fill whole pages (a request that resumes there shares those pages and writes its own from
the next one: no page is ever written by two requests). So every edge of the tree is one page of
`page_size` tokens and a node is the page that holds them; SGLang's radix tree splits edges at any
token, which buys nothing here.

Glossary:
- *node*: one cached page, keyed under its parent by its `page_size` token ids; the path from the
  root spells the prefix, the node's page holds the caches of its tokens (target and proposer).
- *snapshot*: the KDA conv windows and states after a node's last token, in a pool of its own
  (`CacheManager.snapshots`), plus the target features of that token when the proposer needs them.
- *hit*: the deepest node with a snapshot along a request's tokens (never the request's last token:
  it must be computed to give logits); the request shares the path's pages, restores the snapshot
  and computes from there.

Invariants: the tree holds one reference on every node's page (`SharedPages.refs`), a running
request one on every page of its table row; a page returns to the free list when nobody references
it. A node's page is never written after it joined the tree (requests write only at positions at or
past their own computed length, and a hit starts at a page boundary past the shared pages; a
proposer that rewrites the entry before it, `Proposer.needs_last_features`, gets a copy of the last
shared page). Every leaf has a snapshot or is removed (pages past the deepest snapshot on their path
cannot be resumed from). Eviction takes the least recently used evictable leaf (its page referenced
by the tree alone) and its snapshot, or, when only a snapshot is needed, the least recently used
snapshot.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hylo.memory.pages import FreeList, SharedPages


@dataclass(eq=False)
class PageNode:
    page: int
    tokens: tuple[int, ...]
    parent: PageNode | None
    depth: int  # pages from the root, this one included
    snapshot: int | None = None
    last_used: int = 0
    children: dict[tuple[int, ...], PageNode] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixHit:
    """A request's cached prefix: `pages` back its first `length` positions (`length` a multiple of
    the page size), `snapshot` holds the KDA states after position `length - 1`."""

    pages: list[int]
    snapshot: int
    length: int


class PrefixListener(Protocol):
    """Told of every change to the tree's pages, on the thread that makes it (the engine's), while the
    change is made: it must only record what it is told (`hylo.server.kv_events` publishes them)."""

    def stored(self, node: PageNode) -> None:
        """`node` joined the tree; its parent is the root or a node `stored` before."""

    def removed(self, node: PageNode) -> None:
        """`node` left the tree; its children (if it had any) were `removed` before."""

    def cleared(self) -> None:
        """Every node left the tree at once (`clear`), with no `removed` for them."""


@dataclass
class PrefixStats:
    """Counters since start-up: `query_tokens` of the requests admitted, `hit_tokens` of them found in
    the cache, pages and snapshots evicted to make room (pages left without a snapshot below them
    when theirs was evicted count as evicted pages)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    evicted_snapshots: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """The tree of cached pages of `page_size` tokens (see the module docstring): it holds references
    on `pages` and takes its snapshots' ids from `snapshot_ids` (the `CacheManager`'s, which owns the
    memory behind both). A snapshot is taken where a prefill chunk crosses a page boundary that is a
    multiple of `snapshot_interval` tokens, and at the last page boundary before the end of what the
    prefill computes (so a prompt sent again, or a conversation's next turn, resumes from its last full
    page). A `listener` (PrefixListener), when set, is told of every page joining or leaving the tree."""

    def __init__(self, pages: SharedPages, snapshot_ids: FreeList, page_size: int, snapshot_interval: int):
        if snapshot_interval < page_size or snapshot_interval % page_size:
            raise ValueError(
                f"prefix_snapshot_interval ({snapshot_interval}) must be a multiple of "
                f"page_size ({page_size})"
            )
        self.pages, self.snapshot_ids = pages, snapshot_ids
        self.page_size = page_size
        self.interval = snapshot_interval
        self.root = PageNode(page=-1, tokens=(), parent=None, depth=0)
        self.num_nodes = 0
        self.stats = PrefixStats()
        self._clock = itertools.count(1)
        self._snapshot_nodes: dict[int, PageNode] = {}  # snapshot id -> the node that holds it
        self.listener: PrefixListener | None = None

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshot_nodes)

    def _pages_of(self, tokens: Sequence[int], num_pages: int):
        ps = self.page_size
        for i in range(num_pages):
            yield tuple(tokens[i * ps : (i + 1) * ps])

    def match(self, tokens: Sequence[int]) -> PrefixHit | None:
        """The deepest snapshot along `tokens` short of their last token, or None; marks the path used.
        Takes no reference: the caller shares the pages before anything can be evicted."""
        node, best, path = self.root, None, []
        for key in self._pages_of(tokens, (len(tokens) - 1) // self.page_size):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
            if node.snapshot is not None:
                best = node
        if best is None:
            return None
        now = next(self._clock)
        for n in path[: best.depth]:
            n.last_used = now
        return PrefixHit([n.page for n in path[: best.depth]], best.snapshot, best.depth * self.page_size)

    def snapshot_positions(self, tokens: Sequence[int], start: int, stop: int, end: int) -> list[int]:
        """Positions in `(start, stop]` where a chunk computing positions `start .. stop - 1` of
        `tokens` should leave a snapshot: page boundaries that are multiples of the interval, and the
        last page boundary before `end` (the end of what the prefill computes), less those the tree
        already has."""
        ps = self.page_size
        last = (end - 1) // ps * ps
        wanted = [
            s for s in range((start // ps + 1) * ps, stop + 1, ps) if s % self.interval == 0 or s == last
        ]
        if not wanted:
            return []
        have, node = set(), self.root
        for key in self._pages_of(tokens, wanted[-1] // ps):
            node = node.children.get(key)
            if node is None:
                break
            if node.snapshot is not None:
                have.add(node.depth * ps)
        return [s for s in wanted if s not in have]

    def alloc_snapshot(self) -> int | None:
        """A free snapshot id, evicting the least recently used snapshot if none is free; None when the
        pool is empty."""
        got = self.snapshot_ids.alloc(1)
        if got is not None:
            return got[0]
        if not self._snapshot_nodes:
            return None
        victim = min(self._snapshot_nodes.values(), key=lambda n: n.last_used)
        self._drop_snapshot(victim)
        self.stats.evicted_snapshots += 1
        self._prune(victim)
        return self.snapshot_ids.alloc(1)[0]

    def free_snapshot(self, sid: int) -> None:
        self.snapshot_ids.free([sid])

    def insert(self, tokens: Sequence[int], pages: Sequence[int], position: int, snapshot: int) -> None:
        """Publish the first `position` tokens (a page boundary) of a request whose caches hold them in
        `pages`, with `snapshot` taken after position `position - 1`; a prefix the tree already has
        keeps its own pages and snapshot (then `snapshot` is freed)."""
        self.insert_snapshots(tokens, pages, [(position, snapshot)])

    def insert_snapshots(
        self, tokens: Sequence[int], pages: Sequence[int], snapshots: Sequence[tuple[int, int]]
    ) -> None:
        """`insert` for each (position, snapshot) of `snapshots` in one walk down the tree: a 13K-token
        prompt's 13 snapshots walk its 832 pages once (the walks one by one made ~5800 page keys, 3-5 ms
        on the CPU machine before its first token was returned)."""
        for position, _ in snapshots:
            if position <= 0 or position % self.page_size:
                raise ValueError(f"snapshots: position {position} is not a page boundary past 0")
        at_depth = {position // self.page_size: sid for position, sid in snapshots}
        node, now = self.root, next(self._clock)
        for i, key in enumerate(self._pages_of(tokens, max(at_depth, default=0))):
            child = node.children.get(key)
            if child is None:
                child = PageNode(pages[i], key, node, node.depth + 1)
                node.children[key] = child
                self.pages.share([pages[i]])
                self.num_nodes += 1
                if self.listener is not None:
                    self.listener.stored(child)
            child.last_used = now
            node = child
            snapshot = at_depth.get(node.depth)
            if snapshot is None:
                continue
            if node.snapshot is None:
                node.snapshot = snapshot
                self._snapshot_nodes[snapshot] = node
            else:
                self.free_snapshot(snapshot)

    def evict_pages(self, num_pages: int) -> int:
        """Free up to `num_pages` pages by evicting least recently used leaves that only the tree
        references; returns how many were freed."""
        refs = self.pages.refs
        heap = [(n.last_used, id(n), n) for n in self.nodes() if not n.children and refs[n.page] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            self.stats.evicted_pages += 1
            freed += 1
            if parent is not self.root and not parent.children and refs[parent.page] == 1:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def num_evictable_pages(self) -> int:
        """Pages `evict_pages` could free now: nodes whose page, and every page below them, only the
        tree references."""
        refs, evictable = self.pages.refs, {}
        for node in sorted(self.nodes(), key=lambda n: -n.depth):  # children before their parents
            evictable[node] = refs[node.page] == 1 and all(evictable[c] for c in node.children.values())
        return sum(evictable.values())

    def clear(self) -> None:
        """Drop every node and snapshot (pages still used by running requests stay theirs)."""
        for node in list(self.nodes()):
            if node.snapshot is not None:
                self._drop_snapshot(node)
        for node in sorted(self.nodes(), key=lambda n: -n.depth):
            self._remove(node, announce=False)
        if self.listener is not None:
            self.listener.cleared()

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _drop_snapshot(self, node: PageNode) -> None:
        del self._snapshot_nodes[node.snapshot]
        self.free_snapshot(node.snapshot)
        node.snapshot = None

    def _remove(self, node: PageNode, announce: bool = True) -> None:
        """Unlink a leaf, free its snapshot and drop the tree's reference on its page; tell the
        listener unless `announce` is False (`clear` tells it once for all)."""
        assert not node.children
        if node.snapshot is not None:
            self._drop_snapshot(node)
        del node.parent.children[node.tokens]
        self.pages.unshare([node.page])
        self.num_nodes -= 1
        if announce and self.listener is not None:
            self.listener.removed(node)

    def _prune(self, node: PageNode) -> None:
        """Remove leaves without a snapshot from `node` upwards: nobody can resume inside them."""
        while node is not self.root and not node.children and node.snapshot is None:
            parent = node.parent
            self._remove(node)
            self.stats.evicted_pages += 1
            node = parent
