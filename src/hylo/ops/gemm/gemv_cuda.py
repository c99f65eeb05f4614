"""The FP8 GEMV in CUDA C++: `x [M, K] @ dequant(W)[N, K]ᵀ` for M ≤ 16 on Hopper, near the weight-read floor.

`fp8_gemv.cu` holds the kernel and why it is shaped as it is (tensor-core MMAs with the weight rows as
the M side, e4m3 widened in registers, 128-k scale blocks applied per partial, K split over the warps of
a CTA and over the CTAs of a cluster, reduced in shared memory in one launch). Here: when it may run
(`refusal`), how it is built and loaded, and the launch (`gemv`).

Built at first use on the GPU machine: `cuda_build.build` compiles it for `sm_90a` with the machine's
nvcc into the kernel cache, and `ctypes` loads it (compilation at most once per process and machine;
the cache key covers the source, nvcc's version and the arch). Before a GPU's first product the library
is checked once on that GPU against the float64 product (`_self_check`: every compiled variant, ragged N
and K, every e4m3 code including subnormals): the kernel was written on a machine without a GPU, so a
library that fails its check (or does not build, or a non-Hopper GPU) is refused for the whole process
with one warning, and the caller keeps the Triton kernel. The check needs an eager call: a GPU whose
first FP8 product comes inside a CUDA graph capture is refused for that call (hylo's engine warms every
graph up eagerly before capturing it, so its graphs get the kernel).

A call is a ctypes call that launches on `torch.cuda.current_stream()` with raw pointers: nothing is
allocated but the output and nothing synchronises, so it is capture-safe, and its host cost (a few us
of Python, below Triton's launcher) is assumed small enough to use eagerly too: the lead measures it.
`HYLO_FP8_GEMV=0` in the environment turns it off (read at every call); a benchmark comparing it with
the Triton kernel in one process calls `gemv` and `kernels.gemm` directly.

Launches are programmatic dependents where `ops.dependent_launch` says a device's launches are
(`fp8_gemv.cu` says what the GEMV overlaps then); a benchmark may force either way per call. A dependent
GEMV reads its first weight blocks and scales before its wait, so it is safe to use when the kernel
launched just before it did not write them (a model's weights are written at load, never by a step;
a caller that writes a weight and multiplies by it at once launches the GEMV with `dependent=False`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from functools import cache
from pathlib import Path

import torch

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dispatch import use_kernel
from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.gemm import cuda_build

logger = logging.getLogger("hylo")

SOURCE = Path(__file__).with_name("fp8_gemv.cu")
KERNEL = "the FP8 GEMV kernel"
SWITCH = "HYLO_FP8_GEMV"
MAX_ROWS = 16
CTA_ROWS = 64  # weight rows per CTA (4 warps of a 16-row MMA tile); the library reports its own
SPLITS = (1, 2, 4, 8)  # CTAs of a cluster that split K (the compiled variants)
SLICES = (2, 4)  # warps of a CTA over K (the compiled variants; 4 for up to WIDE_ROWS rows of x)
WIDE_ROWS = 8
CHECK_ROWS = (3, 13)  # one row count per compiled row tile (8 and 16 rows of x)


def split_for(n: int, k: int, sms: int) -> int:
    """CTAs per cluster along K: the fewest that give about one CTA on every SM, without more K slices
    (2 warps per CTA) than 128-k blocks. Not the two a SM could hold (256 threads at <= 128 registers
    each, the kernel's launch bounds): on the H100 the N = 4096 projections ran 16-30% faster at split
    2 than at the split 4 that fills both (RESULTS S30-5)."""
    row_groups, kblocks = -(-n // CTA_ROWS), -(-k // FP8_BLOCK)
    allowed = [s for s in SPLITS if s == 1 or 2 * s <= kblocks]
    return next((s for s in allowed if row_groups * s >= 0.9 * sms), allowed[-1])


def slices_for(m: int, n: int, k: int, split: int, sms: int) -> int:
    """Warps of a CTA over K: 4 (a CTA of 16 warps, one a SM) where the grid is one wave (at most one CTA
    a SM) and each of the 4·split K slices still streams at least 8 blocks; else 2. Measured on the H100
    at one row of x (RESULTS S32-4): 4 is 5-11% faster on 4096 × 8192 and × 16384, 8-27% slower on
    multi-wave or short-K shapes; compiled for up to `WIDE_ROWS` rows only."""
    ctas = -(-n // CTA_ROWS) * split
    wide = m <= WIDE_ROWS and ctas <= sms and -(-k // FP8_BLOCK) >= 8 * 4 * split
    return 4 if wide else 2


@cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class GemvRows(ctypes.Structure):
    """x, bf16 `[m, k]` (`fp8_gemv.cu`'s `GemvRows`)."""

    _fields_ = [("data", ctypes.c_void_p), ("stride", ctypes.c_longlong), ("m", ctypes.c_int)]


class BlockScaledWeight(ctypes.Structure):
    """e4m3 `[n, k]` with its 128 × 128 block scales (`fp8_gemv.cu`'s `BlockScaledWeight`)."""

    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("scale_stride", ctypes.c_longlong),
                ("n", ctypes.c_int), ("k", ctypes.c_int)]  # fmt: skip


class GemvPlan(ctypes.Structure):
    """CTAs of a cluster over K, warps of a CTA over K, and whether the launch is a dependent one."""

    _fields_ = [("split", ctypes.c_int), ("slices", ctypes.c_int), ("dependent", ctypes.c_int)]


class GemvCall(ctypes.Structure):
    """One launch's operands (`fp8_gemv.cu`'s `GemvCall`, field for field)."""

    _fields_ = [("x", GemvRows), ("w", BlockScaledWeight), ("out", ctypes.c_void_p), ("plan", GemvPlan)]


@cache
def load_library(arch: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """The built and loaded library for `arch` (`defines`: a variant's macros, `fp8_gemv.cu`'s
    `HYLO_GEMV_*`), or why there is none (warned once per process)."""
    try:
        library = ctypes.CDLL(str(cuda_build.build(SOURCE, arch, KERNEL, defines)))
    except (cuda_build.BuildError, OSError) as e:
        return _give_up(f"{KERNEL} is not available: {e}")
    if library.hylo_fp8_gemv_cta_rows() != CTA_ROWS:
        return _give_up(
            f"{KERNEL} tiles {library.hylo_fp8_gemv_cta_rows()} rows per CTA, gemv_cuda {CTA_ROWS}"
        )
    try:
        cuda_build.bind_call(library, "hylo_fp8_gemv", GemvCall)
    except OSError as e:
        return _give_up(f"{KERNEL}: {e}")
    return library


def _give_up(reason: str) -> str:
    logger.warning("%s; FP8 products of up to %d rows run the Triton kernel", reason, MAX_ROWS)
    return reason


def device_refusal(device: torch.device) -> str | None:
    """Why the GEMV is off on `device` (None: on), building and checking it there first if need be."""
    return _CHECKED.refusal(device)


def refusal(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> str | None:
    """Why `gemv` cannot take `x [M, K] @ weight [N, K]ᵀ` with these scales (None: it can)."""
    if not x.is_cuda:
        return "x is not on a CUDA device"
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows of x; the GEMV takes 1 to {MAX_ROWS}"
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        return (
            f"dtypes x {x.dtype}, weight {weight.dtype}, scale {scale_inv.dtype}; it takes bf16, e4m3, fp32"
        )
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if weight.shape[1] != k or tuple(scale_inv.shape) != blocks or scale_inv.stride(1) != 1:
        return f"weight {tuple(weight.shape)} with scale {tuple(scale_inv.shape)} for x {tuple(x.shape)}"
    if k % 16:
        return f"K={k} is not a multiple of 16 (the kernel reads e4m3 rows 16 bytes at a time)"
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return "rows of x are not contiguous and 16-byte aligned"
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return "the weight is not contiguous and 16-byte aligned"
    if x.device.index != torch.cuda.current_device():
        return f"x is on GPU {x.device.index}, the current device is {torch.cuda.current_device()}"
    return device_refusal(x.device)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    split: int | None = None,
    library: ctypes.CDLL | None = None,
    dependent: bool | None = None,
    slices: int | None = None,
) -> torch.Tensor:
    """`x [M, K] @ dequant(weight)ᵀ` as bf16 `[M, N]`, fp32 accumulation. Safe where `refusal` is None
    (which also builds and checks the kernel); `split` (one of `SPLITS`) overrides `split_for`, `slices`
    (one of `SLICES`; 4 only for up to `WIDE_ROWS` rows) `slices_for`; `library` (a benchmark's variant
    that passed `check_library`) overrides the checked one; `dependent` overrides `dependent_launches`."""
    index = x.device.index
    library = library or _CHECKED.ready.get(index)
    if library is None:
        raise RuntimeError(f"gemv: {KERNEL} is not checked on GPU {index}; ask refusal() first")
    (m, k), n = x.shape, weight.shape[0]
    split = split or split_for(n, k, _sms(index))
    slices = slices or slices_for(m, n, k, split, _sms(index))
    if dependent is None:
        dependent = dependent_launches(x.device)
    return _launch(library, x, weight, scale_inv, split, slices, dependent)


def _launch(library, x, weight, scale_inv, split: int, slices: int, dependent: bool) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    call = GemvCall(
        x=GemvRows(x.data_ptr(), x.stride(0), m),
        w=BlockScaledWeight(weight.data_ptr(), scale_inv.data_ptr(), scale_inv.stride(0), n, k),
        out=out.data_ptr(),
        plan=GemvPlan(split, slices, int(dependent)),
    )
    error = library.hylo_fp8_gemv(ctypes.byref(call), torch.cuda.current_stream(x.device).cuda_stream)
    if error:
        raise RuntimeError(
            f"{KERNEL}: launch failed with cudaError {error} (M={m}, N={n}, K={k}, split {split}, "
            f"{slices} warps over K)"
        )
    return out


def exact_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The e4m3 weight times its block scales in float64 (exact: 4 × 24 significant bits fit in 53)."""
    n, k = weight.shape
    scale = scale_inv.double().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.double() * scale


def worst_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> float:
    """The largest |out - y| / bound over the outputs, y the float64 product; ≤ 1 is within the GEMV's
    arithmetic. Bound = 2^-8 |y| (bf16 rounding of the output) + c·2^-22 (|x| @ |W|ᵀ) with
    c = 128 + ceil(K/128) + 16 additions that round in fp32: 128 in a block's MMA chain (2^-23 each if
    the tensor core truncates), one scaled add per block and at most 16 in the split-K reduction (2^-24
    each), times 2 for the fp32 rounding of the bound's own terms."""
    x64, w64 = x.double(), exact_weight(weight, scale_inv)
    y = x64 @ w64.t()
    additions = 128 + -(-x.shape[1] // FP8_BLOCK) + 16
    bound = 2.0**-8 * y.abs() + additions * 2.0**-22 * (x64.abs() @ w64.abs().t())
    return float(((out.double() - y).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())


def random_e4m3(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight with every code but NaN equally likely (zeros and subnormals included) and block
    scales spread over 2^-12 .. 2^0: inputs that reach every path of a conversion."""
    device = generator.device
    codes = torch.randint(0, 254, (n, k), generator=generator, device=device, dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()  # skip 0x7f (NaN): 0..253 -> 0x00..0x7e, 0x80..0xfe (never 0xff)
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    scale = torch.exp2(-12 * torch.rand(blocks, generator=generator, device=device))
    return weight, scale


def check_library(library: ctypes.CDLL, device: torch.device) -> str | None:
    """`_self_check` for a benchmark's variant library (`load_library` with defines)."""
    return _self_check(library, device)


def _self_check(library: ctypes.CDLL, device: torch.device) -> str | None:
    """Every compiled variant (row tile × split × warps over K, launched plainly and as a dependent) against
    the float64 product, on ragged problems: N=200 (a CTA with one partial tile and three past N), K=1040 (a
    16-wide last block; 9 blocks over up to 32 K slices, some empty) and K=1024 (whole blocks: the kernels
    whose loads take no bounds), rows of x strided. The first failure, or None."""
    generator = torch.Generator(device=device).manual_seed(1234)
    n = 200
    for k, m in itertools.product((1040, 1024), CHECK_ROWS):
        weight, scale = random_e4m3(n, k, generator)
        x = torch.randn(MAX_ROWS, k + 16, generator=generator, device=device).to(torch.bfloat16)[:m, :k]
        slices = [s for s in SLICES if s == 2 or m <= WIDE_ROWS]
        for split, wide, dependent in itertools.product(SPLITS, slices, (False, True)):
            try:
                out = _launch(library, x, weight, scale, split, wide, dependent)
                error = worst_error(out, x, weight, scale)
            except RuntimeError as e:
                return str(e)
            if not error <= 1.0:  # NaN fails too
                return (
                    f"M={m}, N={n}, K={k}, split {split}, {wide} warps over K, dependent {dependent}: "
                    f"error {error:.3g}× its bound"
                )
    return None


def takes(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """The dispatch rule: `linear` runs this FP8 product on the GEMV when `refusal` has nothing against
    it; otherwise the Triton kernel runs it (`hylo.ops.dispatch` logs each reason once)."""
    return use_kernel(
        "gemm.fp8_gemv",
        x,
        lambda: refusal(x, weight, scale_inv),
        kernel="the CUDA GEMV",
        fallback="the Triton kernel",
    )


_CHECKED = cuda_build.CheckedLibrary(KERNEL, SWITCH, load_library, _self_check, _give_up)
