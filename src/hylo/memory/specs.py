"""Typed cache specs: every pool of the memory plan states what one unit of it costs and allocates
itself; `MemoryPlan.from_budget` sums them from one budget.

A pool is sized by one of three units: token-cache slots (`TOKEN`: the target's DSA caches, a DFlash
draft's context K/V, the MTP layer's caches; they grow with the pages), request slots (`SLOT`: the KDA
state of one running request) or prefix-cache snapshots (`SNAPSHOT`). vLLM's `KVCacheSpec` /
`MambaSpec` is the model of the idea.

Invariant: `allocate(n, device)` takes `n · bytes_per_unit()` bytes (pools of per-k-pool rows amortise
those rows over the tokens of a pool, so `n` is then a multiple of the pool size).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from hylo.config import ModelConfig
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache


class Unit(enum.Enum):
    TOKEN = "token"
    SLOT = "slot"
    SNAPSHOT = "snapshot"


class CacheSpec(ABC):
    """One pool: `name` (for reports), `unit` (what the plan sizes it by), its bytes per unit, and how
    it allocates `count` units on a device. The allocated pool is safe to use at once (zeroed)."""

    name: str
    unit: Unit

    @abstractmethod
    def bytes_per_unit(self) -> float: ...

    @abstractmethod
    def allocate(self, count: int, device: torch.device | str) -> Any: ...


@dataclass(frozen=True)
class TokenCacheSpec(CacheSpec):
    """Per-token caches of a model's DSA layers (MLA latents, indexer keys, gates, pooled keys)."""

    config: ModelConfig
    dtype: torch.dtype
    indexer_dtype: torch.dtype | None = None
    name: str = "tokens"
    unit = Unit.TOKEN

    def bytes_per_unit(self) -> float:
        return TokenCache.bytes_per_token(self.config, self.dtype, self.indexer_dtype)

    def allocate(self, count: int, device: torch.device | str) -> TokenCache:
        return TokenCache(self.config, count, self.dtype, device, self.indexer_dtype)


@dataclass(frozen=True)
class StateSlotSpec(CacheSpec):
    """Every KDA layer's conv window and fp32 S for one running request."""

    config: ModelConfig
    dtype: torch.dtype
    name: str = "kda_states"
    unit = Unit.SLOT

    def bytes_per_unit(self) -> float:
        return StateCache.bytes_per_slot(self.config, self.dtype)

    def allocate(self, count: int, device: torch.device | str) -> StateCache:
        return StateCache(self.config, count, self.dtype, device)


@dataclass
class Snapshots:
    """The prefix cache's snapshots: KDA states (`states`, one slot a snapshot) and, for a proposer
    that resumes from them, the target features of each snapshot's last token (`features`)."""

    states: StateCache
    features: torch.Tensor  # [snapshots, feature_dim]


@dataclass(frozen=True)
class SnapshotSpec(CacheSpec):
    """A prefix-cache snapshot: one request slot's KDA state and `feature_dim` features."""

    config: ModelConfig
    dtype: torch.dtype
    feature_dim: int = 0
    name: str = "prefix_snapshots"
    unit = Unit.SNAPSHOT

    def bytes_per_unit(self) -> float:
        return StateCache.bytes_per_slot(self.config, self.dtype) + self.feature_dim * self.dtype.itemsize

    def allocate(self, count: int, device: torch.device | str) -> Snapshots:
        features = torch.zeros(count, self.feature_dim, dtype=self.dtype, device=device)
        return Snapshots(StateCache(self.config, count, self.dtype, device), features)


def bytes_per(specs: list[CacheSpec], unit: Unit) -> float:
    """What one unit costs summed over the pools sized by it."""
    return sum(spec.bytes_per_unit() for spec in specs if spec.unit is unit)
