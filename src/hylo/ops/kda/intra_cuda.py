"""KDA's in-chunk launch in CUDA C++ (`intra.cu`, Hopper): the twin of `chunk._intra_kernel` on the same
buffers (the first launch's q, k, v, norms, G and β in; w, q̄, k̄, u and A out).

`intra.cu` says how it is shaped. Built at first use on the GPU machine by `gemm.cuda_build` (the kernel
cache, the machine's nvcc, `sm_90a`) and loaded with `ctypes`; before a GPU's first call it is checked there
once against the Triton launch on a varlen batch (`_self_check`), and a library that fails (or does not build,
or a GPU that is not Hopper) is refused for the process with one warning: the Triton launch runs.
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


def refusal(device: torch.device, head_size: int, dtype: torch.dtype) -> str | None:
    """Why `intra` cannot run these buffers on `device` (None: it can; builds and checks it at a first
    call)."""
    if device.type != "cuda":
        return "the buffers are not on a CUDA device"
    if head_size != HEAD_SIZE or dtype != torch.bfloat16:
        return f"head size {head_size}, {dtype}: the kernel takes {HEAD_SIZE} in bf16"
    return _CHECKED.refusal(device)


def intra(buffers: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...], lower_bound: float,
          library: ctypes.CDLL | None = None) -> None:  # fmt: skip
    """The in-chunk launch: `buffers` (y `[chunks, 3, H, 64, d]`, rnorm, gcum, beta as `chunk.prep` makes
    them), `outputs` (w, q̄, k̄, u `[chunks, H, 64, d]`, A `[chunks, H, 64, 64]`, written). Safe where `refusal`
    is None."""
    y, rnorm, gcum, beta = buffers
    w, qg, kg, u, att = outputs
    chunks, _, heads, _, d = y.shape
    library = library or _CHECKED.ready[y.device.index]
    call = KdaIntraCall(y.data_ptr(), rnorm.data_ptr(), gcum.data_ptr(), beta.data_ptr(), w.data_ptr(),
                        qg.data_ptr(), kg.data_ptr(), u.data_ptr(), att.data_ptr(), chunks, heads, d,
                        lower_bound)  # fmt: skip
    error = library.hylo_kda_intra(ctypes.byref(call), torch.cuda.current_stream(y.device).cuda_stream)
    if error:
        raise RuntimeError(f"{KERNEL}: launch failed with cudaError {error} ({chunks} chunks, {heads} heads)")


def _self_check(library: ctypes.CDLL, device: torch.device) -> str | None:
    """The launch against the Triton one on a varlen batch of 4 heads (a sequence of one token, one shorter
    than the conv window, two of several chunks): each output within 2^-6 of its largest entry (bf16 outputs
    of the same sums in another order and an exact inverse against composed Neumann products)."""
    from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, chunk

    gen = torch.Generator(device=device).manual_seed(7)
    heads, d = 4, HEAD_SIZE
    hd = heads * d

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    lens = [150, 1, 3, 70]
    tokens = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = KDAInputs(
        *(randn(tokens, hd, dtype=torch.bfloat16) for _ in range(4)),
        randn(tokens, heads, dtype=torch.bfloat16),
    )
    params = KDAParams(randn(3 * hd, 4, scale=0.3), randn(hd, scale=0.5), randn(heads, scale=0.5), -5.0)
    pools = randn(4, 3, 3 * hd, dtype=torch.bfloat16), randn(4, heads, d, d, scale=0.05)
    slots = torch.arange(4, device=device)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=device)
    got = chunk.prep(
        x, params, KDASlots(*(p.clone() for p in pools), slots), cu_dev, cu, intra_library=library
    )
    want = chunk.prep(x, params, KDASlots(*(p.clone() for p in pools), slots), cu_dev, cu)
    for name, a, b in zip(("w", "q̄", "k̄", "u", "A", "e^G_C"), got, want, strict=True):
        worst = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        if not worst <= 2.0**-6:
            return f"{name}: worst difference {worst:.3g} of its largest entry"
    return None


_CHECKED = cuda_build.CheckedLibrary(KERNEL, SWITCH, load_library, _self_check, _give_up)
