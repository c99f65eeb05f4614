"""Tensor and expert parallelism on `torch.distributed`: who holds what (`parallel`, `sharding`), and
how the ranks stay in step (`control`, `launch`)."""

from hylo.distributed.parallel import SINGLE, Parallel

__all__ = ["SINGLE", "Parallel"]
