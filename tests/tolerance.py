"""The one rule for comparing fp32 results that were computed over different batch shapes.

Why a rule at all: BLAS and torch's CPU kernels block a reduction differently for every matrix shape
and every instruction set (AVX2 on one machine, AVX-512 on another, Intel or AMD), so the same sum of
K fp32 products comes out in another order when a token is computed in a batch of 1, of 8, or inside
a verify block. Each order is correct; they agree to about K roundings of the result's scale
(`K · eps32 · max|x|`; the classic worst-case bound of a K-term sum, which also covers the error a
value carries in from the layers before it when K counts the products along the whole chain).

Why this is still tight: a wrong token, a wrong cache slot, or a skipped or doubled commit changes
entries by the order of the tensor's own scale, thousands of times more than the bound (the tiny test
models give bounds of 1e-5 to 1e-4 of the scale).

Where two results must be bit for bit the same (the same kernels over the same shapes: CUDA-graph
replays against eager calls of the same fixed-shape batch, a batch-invariant kernel), tests compare
with `torch.equal` and say so instead of calling this.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps


def model_accumulation_terms(config) -> int:
    """K for a value at the end of a model forward: every layer adds one reduction over its widest
    input (hidden size or an MLP's intermediate size)."""
    widest = max(config.hidden_size, config.intermediate_size, getattr(config, "moe_intermediate_size", 0))
    return config.num_hidden_layers * widest


def draft_accumulation_terms(config) -> int:
    """K for a DFlash draft's output: its `fc` over the concatenated target features, then its layers."""
    return len(config.target_layer_ids) * config.hidden_size + model_accumulation_terms(config)


def relative_tolerance(terms: int) -> float:
    """The largest difference, relative to the tensor's scale, that a reordering of `terms` fp32
    accumulations explains."""
    return terms * FP32_EPS


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| over max |expected|."""
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    return diff / scale if scale else diff


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, terms: int, msg: str = "") -> None:
    """`actual` equals `expected` up to a reordering of `terms` fp32 accumulations (see the module)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not expected.numel():
        return
    atol = relative_tolerance(terms) * expected.float().abs().max().item()
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=atol, msg=lambda m: f"{msg} (K = {terms} terms): {m}" if msg else m
    )
