"""Bias-free projections whose matmuls go through the small-M GEMM dispatch (`ops.gemm`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hylo.ops.gemm import linear


class Linear(nn.Linear):
    """`nn.Linear` without bias (same parameters and state-dict keys), routed through `ops.gemm.linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class FusedLinear(Linear):
    """Several projections of one input as one GEMM: `weight` stacks the parts' weights by rows, in
    order, and `forward` returns each part's output as a view of the one product.

    `parts` are (checkpoint name relative to the owning module, output features): the loader fills
    each part's rows from the checkpoint tensor `{owner}.{name}.weight` (`loader.checkpoint_layout`),
    and saving writes them back under those names, so checkpoints keep the projections apart. The
    views share the product's row stride (kernels that read them take strides)."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]]):
        self.parts = tuple(parts)
        self.sizes = tuple(n for _, n in self.parts)
        super().__init__(in_features, sum(self.sizes))

    def rows(self) -> dict[str, tuple[int, int]]:
        """Each part's name -> its (first, end) rows of `weight`."""
        out, lo = {}, 0
        for name, n in self.parts:
            out[name] = (lo, lo + n)
            lo += n
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weight).split(self.sizes, dim=-1)


def unfused_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every `FusedLinear` weight replaced by its parts under their own
    names (`{owner}.{part}.weight`, views of the rows): the layout of modules that keep the
    projections apart (`transformers`')."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, FusedLinear):
            weight = state.pop(f"{name}.weight")
            owner = name.rpartition(".")[0]
            for part, (lo, hi) in sub.rows().items():
                state[f"{owner}.{part}.weight".lstrip(".")] = weight[lo:hi]
    return state
