"""All per-request memory of one model: token pages, request slots, and the pools they index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hylo.config import ModelConfig
from hylo.memory.pages import FreeList, RequestTable, SharedPages
from hylo.memory.prefix_cache import PrefixCache, PrefixHit
from hylo.memory.specs import CacheSpec, SnapshotSpec, StateSlotSpec, TokenCacheSpec, Unit, bytes_per

# snapshots beyond this many are not worth their memory: a prefix cache rarely holds more live branches
MAX_SNAPSHOTS = 4096
# the share of the cache budget the prefix cache's KDA snapshots take (one is a request slot's state:
# ~136 MiB for GLM-5.3-Flash, so 1/8 of a 40 GiB budget holds 37)
PREFIX_SNAPSHOT_SHARE = 0.125


# what a request-table row holds beside its token slots: the token it sampled last (`last_sampled`)
# and the positions its last verify step committed (`last_committed`)
ROW_BYTES = 12


@dataclass(frozen=True)
class MemoryPlan:
    """How one memory budget is split between token pages and request slots. With `scratch`, one more
    slot and one more page, never handed out, absorb the padding rows of fixed-shape decode batches."""

    num_pages: int
    page_size: int
    num_slots: int
    max_len: int
    bytes_per_token: float
    bytes_per_slot: int
    scratch: bool = False
    # prefix-cache snapshots of every KDA layer's state (plus the proposer's features of one token)
    num_snapshots: int = 0
    bytes_per_snapshot: int = 0

    @property
    def max_total_num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def cache_bytes(self) -> int:
        """What the caches built from this plan allocate, the scratch slot and page included."""
        extra = int(self.scratch)
        tokens = (self.num_pages + extra) * self.page_size * self.bytes_per_token
        snapshots = self.num_snapshots * self.bytes_per_snapshot
        return int(tokens + (self.num_slots + extra) * self.bytes_per_slot + snapshots)

    @classmethod
    def from_budget(
        cls,
        specs: list[CacheSpec],
        budget_bytes: int,
        page_size: int,
        max_running_requests: int | None,
        context_len: int,
        scratch: bool = False,
        snapshot_share: float = 0.0,
    ) -> MemoryPlan:
        """Split one budget between the pools of `specs` by their units: prefix-cache snapshots get
        `snapshot_share` of it (at most `MAX_SNAPSHOTS`); request slots get what
        `max_running_requests` asks, or by default up to half the rest (at most 256); token pages get
        what remains. A slot also pays for its request-table row and its `last_sampled` and
        `last_committed` entries. The `scratch` slot and page are paid for first."""
        per_token = bytes_per(specs, Unit.TOKEN)
        # a model of linear-attention layers only keeps nothing per token: its pages cost no memory
        max_len = min(context_len, int(budget_bytes // per_token)) if per_token else context_len
        per_slot = bytes_per(specs, Unit.SLOT) + ROW_BYTES + 4 * max_len
        per_snapshot = bytes_per(specs, Unit.SNAPSHOT)
        snapshots = (
            min(MAX_SNAPSHOTS, int(budget_bytes * snapshot_share // per_snapshot)) if per_snapshot else 0
        )
        budget_bytes -= snapshots * per_snapshot
        if scratch:
            budget_bytes -= per_slot + per_token * page_size
        slots = max_running_requests or min(256, int(budget_bytes // 2 // per_slot))
        if per_token:
            pages = int((budget_bytes - slots * per_slot) // (per_token * page_size))
        else:  # every slot can reach max_len (the scratch page included)
            pages = slots * -(-max_len // page_size) + scratch if budget_bytes >= slots * per_slot else 0
        if slots < 1 or pages < 1:
            raise ValueError(
                f"memory budget of {budget_bytes / 2**20:.1f} MiB is too small: one request slot needs "
                f"{per_slot / 2**20:.1f} MiB and one page of {page_size} tokens "
                f"{per_token * page_size / 2**20:.2f} MiB"
            )
        # the table rows were paid for at the longest max_len the budget allowed; the pages cap it
        max_len = min(max_len, pages * page_size)
        per_slot = bytes_per(specs, Unit.SLOT) + ROW_BYTES + 4 * max_len
        return cls(
            pages, page_size, slots, max_len, per_token, per_slot, scratch, snapshots, int(per_snapshot)
        )


def copies_last_page(proposer: Any) -> bool:
    """Whether a request resuming from a prefix snapshot gets a private copy of its last shared page
    (and the snapshot's features): for a proposer that rewrites the entry before its first new
    position (`Proposer.needs_last_features`)."""
    return proposer is not None and proposer.needs_last_features


def target_cache_specs(
    config: ModelConfig,
    dtype: torch.dtype,
    indexer_dtype: torch.dtype | None = None,
    snapshot_feature_dim: int | None = None,
) -> list[CacheSpec]:
    """The target model's pools: its token caches, its KDA state slots and, with a prefix cache
    (`snapshot_feature_dim` not None), its snapshots."""
    specs: list[CacheSpec] = [TokenCacheSpec(config, dtype, indexer_dtype), StateSlotSpec(config, dtype)]
    if snapshot_feature_dim is not None:
        specs.append(SnapshotSpec(config, dtype, snapshot_feature_dim))
    return specs


class CacheManager:
    """Owns the caches of the running requests. Each running request holds one slot (its request
    table row and its KDA state slot share the index) and the pages backing its positions.

    Invariants: `pages.num_free` and `slots.num_free` return to their start values once every
    request is released; a slot's state is zeroed when it is handed out. With `plan.scratch`,
    `scratch_slot` (= `plan.num_slots`) is one more request-table row and KDA state slot, every page
    of its row the page `plan.num_pages`: neither is ever handed out, so whatever a padding row
    writes there is nobody's.

    Pages are reference-counted (`pages.refs`): a request holds one reference on every page of its
    row, the prefix cache (`prefix`, with `prefix_snapshot_interval`) one on every page it keeps; a
    page is free once nobody references it. `snapshots` (`plan.num_snapshots` KDA state slots) and
    `snapshot_features` (`[num_snapshots, snapshot_feature_dim]`, the proposer's features of a
    snapshot's last token) are the prefix cache's, handed out by `snapshot_ids`.

    Released pages and slots may still be written by a step in flight (the overlap schedule runs one
    step past a request's end): the device runs steps in order, so whoever takes them next writes
    after it.
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: MemoryPlan,
        dtype: torch.dtype,
        device: torch.device | str,
        indexer_dtype: torch.dtype | None = None,
        prefix_snapshot_interval: int | None = None,
        snapshot_feature_dim: int = 0,
    ):
        if plan.page_size % config.index_kpool:
            raise ValueError(
                f"page_size ({plan.page_size}) must be a multiple of index_kpool ({config.index_kpool})"
            )
        self.plan = plan
        self.kpool = config.index_kpool
        extra = int(plan.scratch)
        self.num_token_slots = (plan.num_pages + extra) * plan.page_size
        prefix = prefix_snapshot_interval is not None
        tokens, states, *snapshots = target_cache_specs(
            config, dtype, indexer_dtype, snapshot_feature_dim if prefix else None
        )
        self.tokens = tokens.allocate(self.num_token_slots, device)
        self.states = states.allocate(plan.num_slots + extra, device)
        snapshots = (snapshots[0] if snapshots else SnapshotSpec(config, dtype)).allocate(
            plan.num_snapshots, device
        )
        self.table = RequestTable(plan.num_slots + extra, plan.max_len, plan.page_size, device)
        self.pages = SharedPages(plan.num_pages)
        self.slots = FreeList(plan.num_slots)
        self.snapshots, self.snapshot_features = snapshots.states, snapshots.features
        self.snapshot_ids = FreeList(plan.num_snapshots)
        self.prefix = None
        if prefix_snapshot_interval is not None:
            self.prefix = PrefixCache(self.pages, self.snapshot_ids, plan.page_size, prefix_snapshot_interval)
        # the token each request-table row sampled last in an overlapped step (`Request.in_flight`), or
        # the anchor its last verify step left, and the positions that verify step committed
        # (`Request.verifying`): the next step's chunk reads them on the device before the host has read
        # them
        self.last_sampled = torch.zeros(self.table.table.shape[0], dtype=torch.long, device=device)
        self.last_committed = torch.zeros(self.table.table.shape[0], dtype=torch.int32, device=device)
        self.scratch_slot = plan.num_slots if plan.scratch else None
        if self.scratch_slot is not None:
            # every position of the scratch row maps into the scratch page (a padding row's writes
            # past the page's length wrap around in it instead of reaching somebody's page)
            pages = self.table.max_len // plan.page_size
            self.table.assign(self.scratch_slot, 0, [plan.num_pages] * pages)

    def acquire_slot(self) -> int | None:
        got = self.slots.alloc(1)
        if got is None:
            return None
        self.states.reset(got)
        return got[0]

    def pages_needed(self, held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.plan.page_size) - held)

    def make_room(self, num_pages: int) -> bool:
        """Whether `num_pages` pages are free, after evicting prefix-cache pages nobody else uses."""
        short = num_pages - self.pages.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict_pages(short)
        return self.pages.num_free >= num_pages

    def alloc_pages(self, n: int) -> list[int] | None:
        """`n` free pages with one reference each (evicting cached ones if needed), or None."""
        return self.pages.alloc(n) if self.make_room(n) else None

    def grow(self, slot: int, pages: list[int], num_tokens: int) -> bool:
        """Back the first `num_tokens` positions of `slot` (appending to `pages`); False, with nothing
        taken, when not enough pages are free."""
        need = self.pages_needed(len(pages), num_tokens)
        if need == 0:
            return True
        new = self.alloc_pages(need)
        if new is None:
            return False
        self.table.assign(slot, len(pages), new)
        pages.extend(new)
        return True

    def share(self, pages: list[int]) -> None:
        self.pages.share(pages)

    def unshare(self, pages: list[int]) -> None:
        """Drop one reference on each page; pages nobody references any more are free."""
        self.pages.unshare(pages)

    def copy_page(self, src: int, dst: int) -> None:
        """The target's caches of page `src` into page `dst` (a private copy of a shared page)."""
        ps = self.plan.page_size
        self.tokens.copy_slots(src * ps, dst * ps, ps)

    @property
    def num_available_pages(self) -> int:
        """Pages free now or that evicting prefix-cache pages would free."""
        return self.pages.num_free + (0 if self.prefix is None else self.prefix.num_evictable_pages())

    def resume(self, slot: int, hit: PrefixHit, pages: list[int], proposer: Any = None) -> None:
        """Start the request in `slot` (its `pages` empty) from a prefix-cache hit whose pages the caller
        already shares: the row maps them, the KDA states and the proposer's features come from the
        snapshot. A proposer that rewrites the entry before a sequence's first new position
        (`needs_last_features`) gets a private copy of the last page: the caller made room for it."""
        pages.extend(hit.pages)
        if copies_last_page(proposer):
            (copy,) = self.alloc_pages(1)
            self.copy_page(pages[-1], copy)
            ps = self.plan.page_size
            proposer.copy_tokens(pages[-1] * ps, copy * ps, ps)
            self.unshare([pages[-1]])
            pages[-1] = copy
            proposer.resume(slot, self.snapshot_features[hit.snapshot])
        self.table.assign(slot, 0, pages)
        self.states.conv[:, slot] = self.snapshots.conv[:, hit.snapshot]
        self.states.recurrent[:, slot] = self.snapshots.recurrent[:, hit.snapshot]

    def release(self, slot: int, pages: list[int]) -> None:
        self.unshare(pages)
        self.slots.free([slot])
        pages.clear()


class LoadPeak:
    """`with LoadPeak(device) as peak:` measures in `peak.bytes` the most memory PyTorch's CUDA allocator
    handed out during the block beyond what it held at the start; None off CUDA (no allocator to ask)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None
        self._start = 0

    def __enter__(self) -> LoadPeak:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers, each storage counted once (tied weights share one)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def memory_report(
    model: torch.nn.Module, plan: MemoryPlan, device: torch.device, load_peak_bytes: int | None
) -> dict[str, Any]:
    """The start-up memory figures: weights, the peak while loading them, the caches' share, what
    PyTorch's allocator holds now (after the caches and any graph capture; CUDA only), and what the
    caches admit."""
    cuda = device.type == "cuda"
    return {
        "weights_bytes": weight_bytes(model),
        "load_peak_bytes": load_peak_bytes,
        "cache_bytes": plan.cache_bytes,
        "torch_allocated_bytes": torch.cuda.memory_allocated(device) if cuda else None,
        "torch_reserved_bytes": torch.cuda.memory_reserved(device) if cuda else None,
        "max_total_num_tokens": plan.max_total_num_tokens,
        "max_running_requests": plan.num_slots,
        "prefix_snapshots": plan.num_snapshots,
    }


def format_memory_report(report: dict[str, Any]) -> str:
    """One log line: byte counts in GiB, counts as they are, `n/a` for what was not measured."""

    def shown(key: str, value: Any) -> str:
        if value is None:
            return f"{key.removesuffix('_bytes')}=n/a"
        if key.endswith("_bytes"):
            return f"{key.removesuffix('_bytes')}={value / 2**30:.2f}GiB"
        return f"{key}={value}"

    return " ".join(shown(k, v) for k, v in report.items())
