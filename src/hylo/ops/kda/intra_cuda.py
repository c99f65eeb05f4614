"""KDA's in-chunk launch in CUDA C++ (`intra.cu`, Hopper): the twin of `chunk._intra_kernel` on the same
buffers (the first launch's q, k, v, norms, G and β in; w, q̄, k̄, u and A out).

`intra.cu` says how it is shaped. Built at first use on the GPU machine by `gemm.cuda_build` (the kernel
cache, the machine's nvcc, `sm_90a`) and loaded with `ctypes`; before a GPU's first call `chunk` checks it
there once against the Triton launch (`chunk._intra_cuda_check`), and a library that fails (or does not
build, or a GPU that is not Hopper) is refused for the process with one warning: the Triton launch runs.
`HYLO_KDA_INTRA_CUDA=0` turns it off (read at every call). Written without a GPU: not yet run.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from hylo.ops.gemm import cuda_build

logger = logging.getLogger("hylo")

SOURCE = Path(__file__).with_name("intra.cu")
SWITCH = "HYLO_KDA_INTRA_CUDA"
KERNEL = "the CUDA KDA in-chunk launch"
HEAD_SIZE = 128  # the head size the kernel is laid out for (GLM-5.3-Flash's)


class KdaIntraCall(ctypes.Structure):
    """One launch's operands (`intra.cu`'s `KdaIntraCall`, field for field)."""

    _fields_ = [("y", ctypes.c_void_p), ("rnorm", ctypes.c_void_p), ("gcum", ctypes.c_void_p),
                ("beta", ctypes.c_void_p), ("w", ctypes.c_void_p), ("qg", ctypes.c_void_p),
                ("kg", ctypes.c_void_p), ("u", ctypes.c_void_p), ("att", ctypes.c_void_p),
                ("chunks", ctypes.c_int), ("heads", ctypes.c_int), ("head_size", ctypes.c_int),
                ("lower_bound", ctypes.c_float)]  # fmt: skip


@cache
def load_library(arch: str = "sm_90a") -> ctypes.CDLL | str:
    """The built and loaded library, or why there is none."""
    try:
        library = ctypes.CDLL(str(cuda_build.build(SOURCE, arch, KERNEL)))
        cuda_build.bind_call(library, "hylo_kda_intra", KdaIntraCall)
    except (cuda_build.BuildError, OSError) as e:
        return _give_up(f"{KERNEL} is not available: {e}")
    return library


def _give_up(reason: str) -> str:
    logger.warning("%s; KDA prefills run the Triton in-chunk launch", reason)
    return reason


def operand_refusal(device: torch.device, head_size: int, dtype: torch.dtype) -> str | None:
    """Why `intra` cannot take these buffers (not whether the library built and passed its check, which
    `chunk` owns: its check runs the Triton launch)."""
    if device.type != "cuda":
        return "the buffers are not on a CUDA device"
    if head_size != HEAD_SIZE or dtype != torch.bfloat16:
        return f"head size {head_size}, {dtype}: the kernel takes {HEAD_SIZE} in bf16"
    return None


def intra(buffers: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...], lower_bound: float,
          library: ctypes.CDLL) -> None:  # fmt: skip
    """The in-chunk launch with `library`: `buffers` (y `[chunks, 3, H, 64, d]`, rnorm, gcum, beta as
    `chunk.prep` makes them), `outputs` (w, q̄, k̄, u `[chunks, H, 64, d]`, A `[chunks, H, 64, 64]`, written).
    Safe where `operand_refusal` is None and the library passed `chunk`'s check."""
    y, rnorm, gcum, beta = buffers
    w, qg, kg, u, att = outputs
    chunks, _, heads, _, d = y.shape
    call = KdaIntraCall(y.data_ptr(), rnorm.data_ptr(), gcum.data_ptr(), beta.data_ptr(), w.data_ptr(),
                        qg.data_ptr(), kg.data_ptr(), u.data_ptr(), att.data_ptr(), chunks, heads, d,
                        lower_bound)  # fmt: skip
    error = library.hylo_kda_intra(ctypes.byref(call), torch.cuda.current_stream(y.device).cuda_stream)
    if error:
        raise RuntimeError(f"{KERNEL}: launch failed with cudaError {error} ({chunks} chunks, {heads} heads)")
