"""RMSNorm: the torch reference and the Triton kernel behind one dispatcher.

CUDA tensors the kernel takes (`refusal` is None) go to `kernels.rms_norm`, one launch in place of
the reference's eight elementwise and reduction kernels; everything else to `reference.rms_norm`, and
so does a call that autograd records (training: the kernel has no backward). `rms_norm_pair` (two
norms of the same tokens, the second written into a cache by slot: a DSA layer's q_a and kv_a
latent) is one launch where `pair_refusal` is None, in place of two norms and the cache store;
`rms_norm_cat` (two norms of the same tokens side by side: an MTP layer's enorm and hnorm) one launch
where `cat_refusal` is None, in place of two norms and the concatenation; `add_rms_norm` (a residual add
and the next block's norm: a DFlash draft's layers) one launch where `add_refusal` is None, in place of the
add and the norm.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.norm import reference
from hylo.ops.norm.reference import NormRows, RowStore

__all__ = [
    "MAX_WIDTH",
    "NormRows",
    "RowStore",
    "add_refusal",
    "add_rms_norm",
    "cat_refusal",
    "pair_refusal",
    "refusal",
    "rms_norm",
    "rms_norm_cat",
    "rms_norm_pair",
    "width_refusal",
]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_WIDTH = 16384  # one row per program, in registers; GLM-5.3-Flash's widest norm is 4096


def refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `kernels.rms_norm` cannot take this call, or None."""
    if x.device != weight.device:
        return "x and weight must be on one device"
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        return f"unsupported dtypes {x.dtype}, {weight.dtype} (supported: {KERNEL_DTYPES})"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
        return "weight must be one contiguous vector as wide as x's last dimension"
    if (reason := width_refusal(x.shape[-1])) is not None:
        return reason
    if x.stride(-1) != 1 or (x.dim() > 2 and not _rows_evenly_strided(x)):
        return "x's rows must have a unit last stride and one row stride"
    return None


def width_refusal(width: int) -> str | None:
    """Why the kernel cannot take rows of `width`, or None."""
    if width > MAX_WIDTH:
        return f"rows of {width}: the kernel holds rows up to {MAX_WIDTH} wide"
    return None


def _rows_evenly_strided(x: torch.Tensor) -> bool:
    """The leading dimensions flatten to rows of one stride without a copy."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight · x / rms(x)` over the last dimension; see `reference.rms_norm`."""
    recorded = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not recorded and use_kernel("norm.rms_norm", x, lambda: refusal(x, weight)):
        from hylo.ops.norm import kernels

        return kernels.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_refusal(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `kernels.add_rms_norm` cannot take this call, or None: what `refusal` asks of `x`, and `x` and
    `delta` contiguous, of one shape, dtype and device."""
    if (reason := refusal(x, weight)) is not None:
        return reason
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        return (
            f"delta {tuple(delta.shape)} {delta.dtype} must match x {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if not (x.is_contiguous() and delta.is_contiguous()):
        return "x and delta must be contiguous"
    return None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x + delta`, `rms_norm` of that sum); see `reference.add_rms_norm`."""
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (x, delta, weight))
    if not recorded and use_kernel("norm.add_rms_norm", x, lambda: add_refusal(x, delta, weight)):
        from hylo.ops.norm import kernels

        return kernels.add_rms_norm(x, delta, weight, eps)
    return reference.add_rms_norm(x, delta, weight, eps)


def _row_sets_refusal(first: NormRows, second: NormRows) -> str | None:
    """What the two-norm kernels (`rms_norm_pair`, `rms_norm_cat`) need of their row sets, or None: each
    one `rms_norm` takes, `[T, w]`, both of the same tokens on one device."""
    for name, rows in (("first", first), ("second", second)):
        if rows.x.dim() != 2:
            return f"the {name} rows must be [T, w]"
        if (reason := refusal(rows.x, rows.weight)) is not None:
            return f"the {name} rows: {reason}"
    if second.x.shape[0] != first.x.shape[0] or second.x.device != first.x.device:
        return "both row sets must have one row per token, on one device"
    return None


def pair_refusal(first: NormRows, second: NormRows, store: RowStore) -> str | None:
    """Why `kernels.rms_norm_pair` cannot take this call, or None."""
    if (reason := _row_sets_refusal(first, second)) is not None:
        return reason
    if store.index.shape != (first.x.shape[0],):
        return "the store's index must have one row per token"
    if store.index.dtype not in (torch.int32, torch.int64):
        return f"the store's index must be int32 or int64, got {store.index.dtype}"
    if store.out.dim() != 2 or store.out.shape[1] != second.x.shape[1] or store.out.stride(1) != 1:
        return f"the store must be [S, {second.x.shape[1]}] with a unit last stride"
    normed = torch.result_type(second.weight, second.x)
    if store.out.dtype != normed:
        return f"the store is {store.out.dtype}, the second norm gives {normed}: the kernel does not cast"
    return None


def rms_norm_pair(first: NormRows, second: NormRows, store: RowStore) -> torch.Tensor:
    """`first`'s RMSNorm returned, `second`'s written into `store`; see `reference.rms_norm_pair`."""
    tensors = (first.x, first.weight, second.x, second.weight)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not recorded and use_kernel("norm.rms_norm_pair", first.x, lambda: pair_refusal(first, second, store)):
        from hylo.ops.norm import kernels

        return kernels.rms_norm_pair(first, second, store)
    return reference.rms_norm_pair(first, second, store)


def cat_refusal(first: NormRows, second: NormRows) -> str | None:
    """Why `kernels.rms_norm_cat` cannot take this call, or None."""
    if (reason := _row_sets_refusal(first, second)) is not None:
        return reason
    if torch.result_type(first.weight, first.x) != torch.result_type(second.weight, second.x):
        return "both norms must give one dtype (the kernel does not cast)"
    return None


def rms_norm_cat(first: NormRows, second: NormRows) -> torch.Tensor:
    """`[T, w1 + w2]`: `first`'s and `second`'s RMSNorms side by side; see `reference.rms_norm_cat`."""
    tensors = (first.x, first.weight, second.x, second.weight)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not recorded and use_kernel("norm.rms_norm_cat", first.x, lambda: cat_refusal(first, second)):
        from hylo.ops.norm import kernels

        return kernels.rms_norm_cat(first, second)
    return reference.rms_norm_cat(first, second)
