"""One manifold-constrained hyper-connection: its learned projection and the pre/post mixing."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.ops.mhc import mhc_post_pre, mhc_pre


class HyperConnection(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.rms_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post, comb, block input) for `streams [T, n, D]`."""
        return mhc_pre(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters)

    def post_pre(
        self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous block's post (its `out`, `post`, `comb`) applied to `streams`, then this
        connection's pre: (new streams, post, comb, block input)."""
        return mhc_post_pre(
            out, streams, post, comb, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps, self.iters
        )
