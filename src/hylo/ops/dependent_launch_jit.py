"""The first statement of a Triton kernel launched as a programmatic dependent (`ops.dependent_launch`
holds the rule and why; only kernel modules import this one)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before this one (its stores visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
