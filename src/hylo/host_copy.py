"""Host values onto the device without making the host wait."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a host list, nested lists, or a CPU tensor) as a tensor on `device`. On CUDA it is
    staged in pinned memory and copied non-blocking: nothing synchronises, and the caching host
    allocator keeps the staging buffer until the copy has run."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
