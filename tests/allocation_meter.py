"""Device memory of the CPU as the tests see it: what `torch.cuda.max_memory_allocated` tells on a GPU."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationMeter(TorchDispatchMode):
    """The CPU's `torch.cuda.max_memory_allocated`: `peak` is the most bytes of storage alive at once
    among the storages that the ops run inside the `with` block return (each storage counted once,
    whatever views of it are made), `live_bytes` what is alive now."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.storages.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, self.live_bytes)
        return out

    @property
    def live_bytes(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(n for _, n in self.storages.values())


def largest_fp32_bytes(model: torch.nn.Module) -> int:
    return 4 * max(t.numel() for t in [*model.parameters(), *model.buffers()])
