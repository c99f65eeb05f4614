"""Programmatic dependent launch (PDL, sm_90 and newer), one rule for every Triton kernel of a decode step.

A kernel launched as a programmatic dependent (`launch_pdl=True`) may start while the kernel before it in
the stream is still running: its programs are placed on the SMs and run up to `griddepcontrol.wait`,
which returns once that kernel has finished and its stores are visible. When the kernel before it lets
dependents go early (`griddepcontrol.launch_dependents`), the launch and the placement of one kernel
overlap the tail of the other; a decode step is some hundred small launches in a row, so this is time
the bytes never needed.

The contract, safe to use when every kernel that takes `PDL` keeps it: `enter(PDL)` is the kernel's first
statement, so it reads nothing and writes nothing before the kernel ahead of it has finished (a dependent
that read early could see stale data; one that wrote early could overwrite what that kernel still reads),
and it lets its own dependents launch as soon as it runs (they wait for it in turn, so at most one kernel
waits ahead). Kernels whose inputs do not depend on the kernel before them (the CUDA GEMV's weights) may
load those before their wait; that is their own docstring's business.

The rule is here and the kernel statement (`enter`) in `ops.dependent_launch_jit`, which only kernel
modules import: a Triton function made before `TRITON_INTERPRET=1` is set cannot run under the
interpreter, and this module is imported early (by the CUDA GEMV's loader).

`dependent_launches(device)`: whether launches on `device` are dependents: a CUDA device of compute
capability 9 or newer, not the Triton interpreter (whose programs run one after another anyway), and not
switched off with `HYLO_PDL=0` (read once per process and device: a captured graph keeps what it was
captured with; benchmarks compare both in two processes).
"""

from __future__ import annotations

import functools
import os

import torch

SWITCH = "HYLO_PDL"


@functools.cache
def dependent_launches(device: torch.device) -> bool:
    """Whether kernels launched on `device` are programmatic dependents (see the module docstring)."""
    if os.environ.get(SWITCH, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
