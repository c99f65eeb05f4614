"""Bias-free projections whose matmuls go through the GEMM dispatch (`ops.gemm`), in the model dtype
or, as FP8 checkpoints store them, in e4m3 with per-[128, 128]-block scales."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.gemm import linear

FP8 = torch.float8_e4m3fn


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


class Linear(nn.Linear):
    """`nn.Linear` without bias (same parameters and state-dict keys), routed through `ops.gemm.linear`.

    After `to_fp8_()` the weight is e4m3 and `weight_scale_inv [ceil(N/128), ceil(K/128)]` (fp32) holds
    its block scales: weight ≈ e4m3 · scale per block, the layout and names of FP8 checkpoints.
    `quantizable=False` marks a weight read as a matrix rather than through `forward` (it stays in
    the model dtype)."""

    def __init__(self, in_features: int, out_features: int, quantizable: bool = True):
        super().__init__(in_features, out_features, bias=False)
        self.quantizable = quantizable
        self.register_buffer("weight_scale_inv", None)

    @property
    def fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv)

    def to_fp8_(self) -> None:
        """Make the weight e4m3 with block scales: new uninitialised tensors on the weight's device
        (a model is converted on the meta device, before its storage is allocated)."""
        if not self.quantizable:
            raise ValueError("this projection's weight is read as a matrix: it stays in the model dtype")
        self.weight, self.weight_scale_inv = _fp8_tensors(self.out_features, self.in_features, self.weight)


def _fp8_tensors(rows: int, k: int, like: torch.Tensor) -> tuple[nn.Parameter, torch.Tensor]:
    weight = nn.Parameter(torch.empty(rows, k, dtype=FP8, device=like.device), requires_grad=False)
    return weight, torch.empty(_blocks(rows), _blocks(k), dtype=torch.float32, device=like.device)


class FusedLinear(Linear):
    """Several projections of one input as one GEMM: `weight` stacks the parts' weights by rows, in
    order, and `forward` returns each part's output as a view of the one product.

    `parts` are (checkpoint name relative to the owning module, output features): the loader fills
    each part's rows from the checkpoint tensor `checkpoint_keys` names (`loader.checkpoint_layout`),
    `{owner}.{name}.weight`, or `{owner}.{name}` for the parts in `bare` (a weight the checkpoint
    stores as a bare parameter, as the indexer's `index_kpool_compress_gate`), and saving writes them
    back under those names, so checkpoints keep the projections apart. The views share the product's
    row stride (kernels that read them take strides).

    `to_fp8_(names)` makes the named parts e4m3: each starts at a 128-row boundary of `weight` (so it
    keeps its own block scales; the rows between parts hold zeros) and the parts left out move to
    `dense_weight` in the model dtype, a second GEMM (a checkpoint may keep a small part unquantised,
    as DeepSeek-V3.2's keep the indexer's weights_proj). A caller that multiplies the dense parts
    itself (from their rows of `dense_weight`, `rows()`) skips that GEMM with `forward(x, dense=False)`."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bare: Collection[str] = ()):
        self.parts = tuple(parts)
        self.sizes = tuple(n for _, n in self.parts)
        self.bare = frozenset(bare)
        if not self.bare <= {name for name, _ in self.parts}:
            raise ValueError(
                f"bare parts {sorted(self.bare)} are not all in {[name for name, _ in self.parts]}"
            )
        super().__init__(in_features, sum(self.sizes))
        self.register_parameter("dense_weight", None)
        self._placement, lo = {}, 0
        for name, n in self.parts:
            self._placement[name] = ("weight", lo, lo + n)
            lo += n

    def rows(self) -> dict[str, tuple[str, int, int]]:
        """Each part's name -> (the parameter holding it, its first row, its end row)."""
        return dict(self._placement)

    def checkpoint_keys(self, module_name: str) -> dict[str, str]:
        """Each part's name -> the checkpoint tensor holding its weight, for this module named
        `module_name` in its model (the parts are named relative to the module holding this one);
        an FP8 part's block scales are that name + `_scale_inv`."""
        owner = module_name.rpartition(".")[0]
        prefix = f"{owner}." if owner else ""
        return {name: prefix + (name if name in self.bare else f"{name}.weight") for name, _ in self.parts}

    def to_fp8_(self, names: Sequence[str] | None = None) -> None:
        names = {name for name, _ in self.parts} if names is None else set(names)
        unknown = names - {name for name, _ in self.parts}
        if unknown:
            raise ValueError(f"no parts named {sorted(unknown)} in {[name for name, _ in self.parts]}")
        placement, fp8_rows, dense_rows = {}, 0, 0
        for name, n in self.parts:
            if name in names:
                placement[name] = ("weight", fp8_rows, fp8_rows + n)
                fp8_rows += _blocks(n) * FP8_BLOCK
            else:
                placement[name] = ("dense_weight", dense_rows, dense_rows + n)
                dense_rows += n
        like = self.weight
        if dense_rows:
            dense = torch.empty(dense_rows, self.in_features, dtype=like.dtype, device=like.device)
            self.dense_weight = nn.Parameter(dense, like.requires_grad)
        self.weight, self.weight_scale_inv = _fp8_tensors(fp8_rows, self.in_features, like)
        self._placement = placement

    def forward(self, x: torch.Tensor, dense: bool = True) -> tuple[torch.Tensor | None, ...]:
        """Each part's output, in `parts` order; with `dense=False` the parts in `dense_weight` are None
        and its GEMM does not run (without a `dense_weight` that changes nothing)."""
        products = {"weight": linear(x, self.weight, self.weight_scale_inv)}
        if dense and self.dense_weight is not None:
            products["dense_weight"] = linear(x, self.dense_weight, dense_part=True)
        return tuple(
            products[param][..., lo:hi] if param in products else None
            for param, lo, hi in self._placement.values()
        )


def unfused_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every `FusedLinear`'s tensors replaced by its parts under their own
    names (`FusedLinear.checkpoint_keys`, and `_scale_inv` for FP8 parts; views of the rows): the
    layout of modules that keep the projections apart (`transformers`')."""
    state = module.state_dict()
    for name, sub in module.named_modules():
        if isinstance(sub, FusedLinear):
            tensors = {param: state.pop(f"{name}.{param}", None) for param in ("weight", "dense_weight")}
            scale = state.pop(f"{name}.weight_scale_inv", None)
            keys = sub.checkpoint_keys(name)
            for part, (param, lo, hi) in sub.rows().items():
                key = keys[part]
                state[key] = tensors[param][lo:hi]
                if param == "weight" and scale is not None:
                    state[key + "_scale_inv"] = scale[lo // FP8_BLOCK : _blocks(hi)]
    return state
