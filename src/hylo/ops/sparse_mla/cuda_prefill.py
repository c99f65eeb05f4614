"""Sparse MLA prefill in CUDA C++ (`sparse_mla_prefill.cu`, Hopper): one CTA a (token, 64 heads).

`sparse_mla_prefill.cu` says why it exists and how it is shaped (a gathering warpgroup filling a ring of
64-row key blocks, two wgmma warpgroups splitting each block's keys for the scores and the output's dims for
the values). Here: when it may run (`refusal`), how it is built, loaded and checked, and the launch
(`prefill`), which computes what `kernels.sparse_mla_prefill` computes, on the same operands.

Built at first use on the GPU machine by `gemm.cuda_build` (the kernel cache, the machine's nvcc, `sm_90a`)
and loaded with `ctypes`. Before a GPU's first call the library is checked there once against a float64
attention of the same bf16 operands (`_self_check`: two head blocks, empty rows inside and after the real
ones, a list whose width is not a multiple of the key block, a token with no row): the kernel was written on
a machine without a GPU, so a library that fails (or does not build, or a GPU that is not Hopper) is refused
for the process with one warning, and the Triton kernel runs. A call launches on the current stream with
raw pointers, allocates only its output and does not synchronise (capture-safe). `HYLO_SPARSE_MLA_CUDA=0`
turns it off (read at every call).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hylo.ops.gemm import cuda_build

SOURCE = Path(__file__).with_name("sparse_mla_prefill.cu")
SWITCH = "HYLO_SPARSE_MLA_CUDA"
KERNEL = "the CUDA sparse MLA prefill"
HEAD_BLOCK = 64  # heads a CTA (the wgmma M)
RANK = 512  # the latent dims the kernel is laid out for (GLM-5.3-Flash's kv_lora_rank)
LOG2E = 1.4426950408889634


class HeadRows(ctypes.Structure):
    """bf16 `[tokens, heads, 512]` (`sparse_mla_prefill.cu`'s `HeadRows`)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("stride_token", ctypes.c_longlong),
        ("stride_head", ctypes.c_longlong),
    ]

    @classmethod
    def of(cls, t: torch.Tensor) -> HeadRows:
        return cls(t.data_ptr(), t.stride(0), t.stride(1))


class SparseMlaCall(ctypes.Structure):
    """One launch's operands (`sparse_mla_prefill.cu`'s `SparseMlaCall`, field for field)."""

    _fields_ = [("q", HeadRows), ("out", HeadRows), ("latent", ctypes.c_void_p),
                ("latent_stride", ctypes.c_longlong), ("rows", ctypes.c_void_p),
                ("rows_stride", ctypes.c_longlong), ("width", ctypes.c_int), ("tokens", ctypes.c_int),
                ("heads", ctypes.c_int), ("scale_log2", ctypes.c_float)]  # fmt: skip


@cache
def load_library(arch: str = "sm_90a", defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The built and loaded library (`defines`: `sparse_mla_prefill.cu`'s `HYLO_SPARSE_MLA_*` macros of a
    variant); raises `cuda_build.BuildError` or OSError."""
    library = ctypes.CDLL(str(cuda_build.build(SOURCE, arch, KERNEL, defines)))
    cuda_build.bind_call(library, "hylo_sparse_mla_prefill", SparseMlaCall)
    return library


def operand_refusal(q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor) -> str | None:
    """Why `prefill` cannot take `q_latent [T, H, R]`, `latent [S, R]` and `rows [T, W]` (not whether the
    library built and passed its check)."""
    if not q_latent.is_cuda:
        return "the queries are not on a CUDA device"
    _, heads, rank = q_latent.shape
    if rank != RANK or latent.shape[-1] != RANK:
        return f"latent rank {rank}: the kernel is laid out for {RANK}"
    if heads % HEAD_BLOCK:
        return f"{heads} heads: the kernel takes blocks of {HEAD_BLOCK}"
    if q_latent.dtype != torch.bfloat16 or latent.dtype != torch.bfloat16:
        return f"queries {q_latent.dtype} and latent {latent.dtype} must both be bf16"
    if rows.dtype != torch.int32:
        return f"rows are {rows.dtype}; the kernel reads int32"
    aligned = all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 for t in (q_latent, latent))
    if not aligned or q_latent.stride(1) % 8 or q_latent.stride(0) % 8 or latent.stride(0) % 8:
        return "queries and latent rows must be contiguous and 16-byte aligned"
    if rows.stride(-1) != 1:
        return "each token's row list must be contiguous"
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why the kernel is off on `device` (None: on), building and checking it there first if need be."""
    return _CHECKED.refusal(device)


def refusal(q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor) -> str | None:
    """Why `prefill` cannot run here (None: it can; builds and checks the kernel on a first call)."""
    return operand_refusal(q_latent, latent, rows) or device_refusal(q_latent.device)


def _launch(library, q_latent, latent, rows, scale: float, out: torch.Tensor) -> None:
    tokens, heads, _ = q_latent.shape
    call = SparseMlaCall(
        q=HeadRows.of(q_latent),
        out=HeadRows.of(out),
        latent=latent.data_ptr(),
        latent_stride=latent.stride(0),
        rows=rows.data_ptr(),
        rows_stride=rows.stride(0),
        width=rows.shape[1],
        tokens=tokens,
        heads=heads,
        scale_log2=scale * LOG2E,
    )
    error = library.hylo_sparse_mla_prefill(
        ctypes.byref(call), torch.cuda.current_stream(q_latent.device).cuda_stream
    )
    if error:
        raise RuntimeError(f"{KERNEL}: launch failed with code {error} ({tokens} tokens, {heads} heads)")


def prefill(
    q_latent: torch.Tensor,
    latent: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Attention of `q_latent [T, H, 512]` over `latent[rows[t]]` (see `reference.sparse_mla`; a token
    without rows gets zeros), bf16, into `out` (rows of 512 contiguous) or a new tensor; safe where
    `refusal` is None."""
    out = torch.empty_like(q_latent) if out is None else out
    _launch(library or _CHECKED.ready[q_latent.device.index], q_latent, latent, rows, scale, out)
    return out


def error_bound(q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, scale: float) -> tuple:
    """(float64 reference, per-element bound) of `prefill` on these operands: the kernel rounds each
    unnormalised probability to bf16 (2^-9 relative) before the value product and its output to bf16, so
    |out - exact| <= 2^-8 · Σ p|v| / Σ p + 2^-8 |exact| (twice the roundings' sum, for the fp32 sums)."""
    valid = rows >= 0
    kv = latent.double()[rows.long().clamp(min=0)]  # [T, W, R]
    scores = torch.einsum("thr,twr->thw", q_latent.double(), kv) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a token with no row: zeros
    exact = torch.einsum("thw,twr->thr", probs, kv)
    weighted = torch.einsum("thw,twr->thr", probs, kv.abs())
    return exact, 2.0**-8 * weighted + 2.0**-8 * exact.abs()


def _self_check(library: ctypes.CDLL, device: torch.device) -> str | None:
    """The kernel on a small problem against a float64 attention of the same bf16 operands: 6 tokens of 128
    heads (two head blocks) over 400 latent rows with lists 200 wide (not a multiple of 64): full lists,
    empty rows among and after the real ones, one token with a single row and one with none. The first
    failure, or None."""
    generator = torch.Generator(device=device).manual_seed(4321)
    tokens, heads, slots, width = 6, 2 * HEAD_BLOCK, 400, 200
    q = torch.randn(tokens, heads, RANK, generator=generator, device=device).bfloat16()
    latent = torch.randn(slots, RANK, generator=generator, device=device).bfloat16()
    rows = torch.randint(0, slots, (tokens, width), generator=generator, device=device, dtype=torch.int32)
    rows[1, 150:] = -1  # a list that ends early
    rows[2, ::3] = -1  # empty rows among the real ones
    rows[3, 1:] = -1  # a single row
    rows[4] = -1  # no row at all
    rows[5, 64:128] = -1  # a whole empty block between real ones
    scale = RANK**-0.5 * 4  # sharper than 1/sqrt(R): the softmax is not flat
    out = torch.empty_like(q)
    try:
        _launch(library, q, latent, rows, scale, out)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        return str(e)
    exact, bound = error_bound(q, latent, rows, scale)
    error = (out.double() - exact).abs()
    if not torch.isfinite(out).all():
        return "non-finite outputs"
    if not (error <= bound + 1e-30).all():
        token, head, dim = (int(i) for i in torch.nonzero(error > bound)[0])
        worst = float((error / bound.clamp(min=1e-30)).max())
        return f"token {token}, head {head}, dim {dim}: off the exact attention by {worst:.3g}x its bound"
    return None


_CHECKED = cuda_build.checked_library(
    KERNEL, SWITCH, load_library, _self_check, "sparse MLA prefill runs the Triton kernel"
)
