"""The torch reference of DFlash2's grouped dynamic causal conv over the rows of each block."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_block_conv(
    x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Rows `x [R, B, H]` (one block of B rows per leading index) convolved causally within their
    block: out[r, i] = Σ_t kernel[r, i, t] · x[r, i − t] over the taps t with i − t ≥ 0, where
    kernel[r, i, t, h] = base_kernel[t, h] + deltas[r, i, t, h // group_size] (`base_kernel [taps, H]`,
    `deltas [R, B, taps, H / group_size]`). Five tensor ops whatever the tap count (pad, kernel add,
    flip, multiply, sum), differentiable in every input; safe for any B >= 1 (taps reaching before the
    block start read zeros: the conv never crosses into the context). In 16-bit dtypes the kernel
    sum and each product round to the dtype and the sum over taps accumulates in fp32 (torch's)."""
    taps = base_kernel.shape[0]
    rows = x.unflatten(-1, (-1, group_size))
    kernel = base_kernel.unflatten(-1, (-1, group_size)) + deltas[..., None]
    padded = F.pad(rows, (0, 0, 0, 0, taps - 1, 0))
    # Window i holds padded rows i .. i + taps − 1, i.e. block rows i − taps + 1 .. i: its entry j is
    # tap taps − 1 − j, hence the kernel's taps reversed.
    windows = padded.unfold(1, taps, 1)
    return (kernel.flip(2).movedim(2, -1) * windows).sum(-1).flatten(-2)
