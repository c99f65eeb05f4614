"""One manifold-constrained hyper-connection: its learned projection and the pre/post mixing."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.ops.mhc import BlockEntry, BlockNorm, HCParams, PendingPost, mhc_enter


class HyperConnection(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.rms_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters

    @property
    def params(self) -> HCParams:
        return HCParams(self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters)

    def enter(
        self, streams: torch.Tensor, pending: PendingPost | None, norm: BlockNorm | None = None
    ) -> BlockEntry:
        """The previous block's `pending` post applied to `streams [T, n, D]` (when given), then this
        connection's pre, then the block's `norm` of the block input (when given)."""
        return mhc_enter(streams, self.params, pending, norm)
