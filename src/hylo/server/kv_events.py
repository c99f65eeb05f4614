"""KV-cache events in vLLM's format (`--kv-events-endpoint`): the prefix cache's pages as they join and
leave it, published on a ZMQ PUB socket, for KV-aware routers (vllm-router's `kv_aware` policy).

The wire is vLLM's KV-events contract: one message per batch, three frames (the topic, empty; the
batch's sequence number, 8 bytes big-endian, counting from 0; a msgpack `KVEventBatch`
`[ts, events, data_parallel_rank]`); each event a msgpack map tagged by `type`: `BlockStored`,
`BlockRemoved` or `AllBlocksCleared`.

What a block is here: one node of the prefix cache (`hylo.memory.prefix_cache`), one page of
`page_size` tokens, announced when the node joins the tree and withdrawn when it leaves it (eviction,
or `AllBlocksCleared` on `/flush_cache`). Its hash is hylo's own: SHA-256 over the parent's hash and
the page's token ids, so equal hashes mean equal prefixes on any hylo server. It is not vLLM's block
hash (which depends on vLLM's hash algorithm and seed): a consumer that hashes the events' `token_ids`
itself (vllm-router) matches hylo's blocks; one that recomputes vLLM's hashes and compares them with
the events' never does.

A request resumes from the deepest KDA snapshot along its cached pages (`--prefix-snapshot-interval`,
and each prompt's last full page), not from any page: a router that credits every matching block
over-counts the tokens skipped by less than one snapshot interval.

pyzmq and msgpack come with the `kv-events` extra (`pip install 'hylo[kv-events]'`).
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

from hylo.memory.prefix_cache import PageNode, PrefixCache


class PageEvents:
    """A `PrefixListener`: the tree's changes as vLLM events, in the order they happen, until `take`
    hands them over. Used on the engine thread alone (where the tree changes)."""

    def __init__(self, page_size: int, medium: str):
        self.page_size, self.medium = page_size, medium
        self._hashes: dict[PageNode, bytes] = {}
        self._pending: list[dict[str, Any]] = []

    def stored(self, node: PageNode) -> None:
        parent = self._hashes.get(node.parent)  # None under the root
        tokens = struct.pack(f"<{len(node.tokens)}q", *node.tokens)  # the same bytes on any machine
        digest = hashlib.sha256((parent or b"") + tokens).digest()
        self._hashes[node] = digest
        last = self._pending[-1] if self._pending else None
        if last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == parent:
            # the next page of the same chain (one insert): one event, as vLLM sends a chain
            last["block_hashes"].append(digest)
            last["token_ids"].extend(node.tokens)
            return
        self._pending.append(
            {
                "type": "BlockStored",
                "block_hashes": [digest],
                "parent_block_hash": parent,
                "token_ids": list(node.tokens),
                "block_size": self.page_size,
                "lora_id": None,
                "medium": self.medium,
                "lora_name": None,
            }
        )

    def removed(self, node: PageNode) -> None:
        digest = self._hashes.pop(node)
        last = self._pending[-1] if self._pending else None
        if last is not None and last["type"] == "BlockRemoved":
            last["block_hashes"].append(digest)
            return
        self._pending.append({"type": "BlockRemoved", "block_hashes": [digest], "medium": self.medium})

    def cleared(self) -> None:
        self._hashes.clear()
        self._pending.append({"type": "AllBlocksCleared"})

    def take(self) -> list[dict[str, Any]]:
        taken, self._pending = self._pending, []
        return taken


class KVEventPublisher:
    """A PUB socket bound to `endpoint` (`tcp://HOST:PORT`; port 0 takes a free one: `endpoint` is then
    the bound address) that publishes a prefix cache's changes once `attach` has made it the cache's
    listener: `publish`, called by the engine thread between steps (`AsyncEngine.between_steps`), sends
    what changed since the last call as one batch (at most one a step, as vLLM). The socket is used by
    the engine thread alone once it runs (ZMQ sockets are not thread-safe). PUB never blocks: a
    subscriber that falls `hwm` batches behind, or joins late, misses batches, and sees the gap in the
    sequence numbers."""

    def __init__(self, endpoint: str):
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError(
                f"--kv-events-endpoint needs pyzmq and msgpack: pip install 'hylo[kv-events]' ({e})"
            ) from None
        self._pack, self._noblock = msgpack.packb, zmq.NOBLOCK
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: {e}") from None
        self.endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.events: PageEvents | None = None
        self._seq = 0

    def attach(self, prefix: PrefixCache, medium: str) -> None:
        """Publish `prefix`'s changes from now on, its blocks in tier `medium` (vLLM's names: `GPU`,
        `CPU`); call before the engine thread starts, while the cache is empty (every page it will hold
        is then announced, with its parent before it)."""
        assert prefix.num_nodes == 0, "KV events start with an empty prefix cache"
        self.events = PageEvents(prefix.page_size, medium)
        prefix.listener = self.events

    def publish(self) -> None:
        """On the engine thread: one batch of the changes since the last call, if there were any."""
        events = self.events.take()
        if events:
            batch = self._pack([time.time(), events, 0])
            self._socket.send_multipart([b"", self._seq.to_bytes(8, "big"), batch], self._noblock)
            self._seq += 1

    def describe(self) -> dict[str, dict[str, Any]]:
        """`GET /kv_event_sources`: this server's one source, keyed by data-parallel rank (vLLM's shape)."""
        return {"0": {"endpoint": self.endpoint, "replay_endpoint": None, "topic": ""}}

    def close(self) -> None:
        """Once the engine thread has stopped."""
        self._socket.close()
        self._context.term()
