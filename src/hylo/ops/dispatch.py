"""How every op family picks between its Triton kernel and its torch reference: one rule, one spelling.

A call runs the family's Triton kernel when its tensors are on a CUDA device and the kernel's verifier
(one per kernel, pure torch, returning the first reason it refuses the call or None) has nothing
against it; otherwise the torch reference runs. Off CUDA that is the design (the references are the
CPU path). A CUDA call that a verifier refuses is logged once per (op, reason) at INFO, so that a model
that falls off its kernels says where and why; `refusals()` counts them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

logger = logging.getLogger("hylo")

Verifier = Callable[[], str | None]
_REFUSED: Counter[tuple[str, str]] = Counter()


def use_kernel(
    op: str,
    tensor: torch.Tensor,
    verify: Verifier | None = None,
    *,
    kernel: str = "the Triton kernel",
    fallback: str = "the torch reference",
) -> bool:
    """Whether the call of `op` whose data is `tensor` runs `kernel`: `tensor` is on CUDA and `verify`
    (asked only then) names no reason against it. `fallback` (what runs otherwise) only names it in the
    log: an op whose fallback is another kernel (the CUDA GEMV's is Triton's) says so."""
    if not tensor.is_cuda:
        return False
    reason = None if verify is None else verify()
    if reason is None:
        return True
    if (op, reason) not in _REFUSED:
        logger.info("%s: %s refuses this call (%s); %s runs it", op, kernel, reason, fallback)
    _REFUSED[op, reason] += 1
    return False


def refusals() -> dict[tuple[str, str], int]:
    """How many CUDA calls each (op, reason) sent to the fallback so far in this process."""
    return dict(_REFUSED)
