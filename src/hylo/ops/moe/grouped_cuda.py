"""The MoE's FP8 grouped GEMMs in CUDA C++ for prefill-sized batches (`grouped_fp8.cu`, Hopper).

`grouped_fp8.cu` says why they exist and how they are shaped (two 64-row blocks of the alignment a CTA,
one weight tile in shared memory for both where they share an expert, a TMA producer warpgroup and two
wgmma consumer warpgroups). Here: when they may run (`refusal`), how they are built, loaded and checked,
and the launches (`gate_up`, `down`), which compute what `kernels._gate_up_tma_kernel` and
`kernels._down_tma_kernel` compute, on the same operands; the MoE dispatches gate|up, and down where its K
is `kernels.CUDA_DOWN_MIN_K` or more. At 13312 tokens on an H100, one CTA a SM taking its tiles from a global
counter and down in 256-column tiles: gate|up 5035 us against the Triton kernel's 6499, down 2661 against
2845 (RESULTS S43-2). gate|up is bound by L2's bandwidth to the SMs (Nsight: L2 throughput 83-90%; each
128 x 256 tile pulls 1.5 MB through it).

Built at first use on the GPU machine by `gemm.cuda_build` (the kernel cache, nvcc of the machine,
`sm_90a`) and loaded with `ctypes`. Before a GPU's first call the library is checked there once against
float64 products of the same e4m3 operands (`_self_check`: pairs of one expert and of two, a lone last
block, padding rows): the kernels were written on a machine without a GPU, so a library that fails (or
does not build, or a GPU that is not Hopper) is refused for the process with one warning, and the
Triton kernels run. The check needs an eager call (hylo's engine warms every graph up eagerly before
capturing it). A call launches on the current stream with raw pointers, allocates only its output and
does not synchronise (capture-safe); the TMA descriptors are encoded on the host at every call (they
hold the operands' addresses). `HYLO_MOE_CUDA=0` turns the kernels off (read at every call).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.gemm import cuda_build
from hylo.ops.moe.routing import Alignment, align

SOURCE = Path(__file__).with_name("grouped_fp8.cu")
SWITCH = "HYLO_MOE_CUDA"
KERNEL = "the CUDA grouped FP8 GEMMs"
BLOCK_M = 64  # the alignment's rows a block (one consumer warpgroup's wgmma M)


_pointer, _size = ctypes.c_void_p, ctypes.c_longlong


class ScaledRows(ctypes.Structure):
    _fields_ = [("data", _pointer), ("stride", _size), ("count", _size), ("scale", _pointer),
                ("scale_stride", _size)]  # fmt: skip


class ScaledExperts(ctypes.Structure):
    _fields_ = [("data", _pointer), ("rows", _size), ("count", _size), ("scale", _pointer),
                ("scale_expert", _size), ("scale_row", _size)]  # fmt: skip


class Blocks(ctypes.Structure):
    _fields_ = [("expert", _pointer), ("rows", _pointer), ("pairs", _pointer), ("count", ctypes.c_int)]


class Output(ctypes.Structure):
    _fields_ = [("data", _pointer), ("stride", _size), ("scale", _pointer), ("scale_stride", _size)]


class GroupedCall(ctypes.Structure):
    _fields_ = [("gate_up", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("limit", ctypes.c_float), ("a", ScaledRows), ("w", ScaledExperts), ("blocks", Blocks),
                ("pair_weight", _pointer), ("out", Output)]  # fmt: skip


@cache
def load_library(arch: str = "sm_90a", defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The built and loaded library (`defines`: `grouped_fp8.cu`'s `HYLO_GROUPED_*` macros of a variant);
    raises `cuda_build.BuildError` or OSError (also where its `GroupedCall` is laid out otherwise)."""
    library = ctypes.CDLL(str(cuda_build.build(SOURCE, arch, KERNEL, defines)))
    cuda_build.bind_call(library, "hylo_grouped_gemm", GroupedCall)
    return library


def device_refusal(device: torch.device) -> str | None:
    """Why the kernels are off on `device` (None: on), building and checking them there first if need be."""
    return _CHECKED.refusal(device)


def refusal(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, layout: Alignment) -> str | None:
    """Why `gate_up` or `down` cannot take rows `a [slots, K]` and experts `weight [E, rows, K]` with
    `scale [E, rows/128, K/128]` (None: they can; builds and checks the kernels on a first call)."""
    return operand_refusal(a, weight, scale, layout) or device_refusal(a.device)


def operand_refusal(
    a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, layout: Alignment
) -> str | None:
    """`refusal` of the operands alone (not whether the kernels built and passed their check)."""
    if not a.is_cuda:
        return "the rows are not on a CUDA device"
    if a.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        return f"rows {a.dtype} and weights {weight.dtype} must both be e4m3"
    experts, rows, k = weight.shape
    if rows % (2 * FP8_BLOCK) or k % FP8_BLOCK:
        # a CTA's columns: gate|up's 128 of the intermediate (256 rows), down's 256 of D
        return f"weights [{experts}, {rows}, {k}]: rows must be multiples of 256 and K of {FP8_BLOCK}"
    if layout.block_m != BLOCK_M:
        return f"the alignment's blocks are {layout.block_m} rows; the kernel takes {BLOCK_M}"
    if not weight.is_contiguous() or a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16:
        return "the weights must be contiguous and the rows 16-byte aligned"
    if a.shape[1] != k or scale.shape != (experts, rows // FP8_BLOCK, k // FP8_BLOCK) or scale.stride(2) != 1:
        return f"rows {tuple(a.shape)}, scale {tuple(scale.shape)} do not match weights {tuple(weight.shape)}"
    return None


def _launch(
    library, gate_up: bool, a, a_scale, weight, scale, layout, pair_weight, out, out_scale, limit
) -> None:
    experts, rows, k = weight.shape
    call = GroupedCall(
        gate_up=int(gate_up),
        n=rows // 2 if gate_up else rows,
        k=k,
        limit=float(limit),
        a=ScaledRows(a.data_ptr(), a.stride(0), a.shape[0], a_scale.data_ptr(), a_scale.stride(0)),
        w=ScaledExperts(weight.data_ptr(), rows, experts, scale.data_ptr(), scale.stride(0), scale.stride(1)),
        blocks=Blocks(
            layout.block_expert.data_ptr(),
            layout.block_rows.data_ptr(),
            layout.pairs.data_ptr(),
            layout.block_expert.numel(),
        ),
        pair_weight=pair_weight.data_ptr(),
        out=Output(out.data_ptr(), out.stride(0), out_scale.data_ptr(), out_scale.stride(0)),
    )
    error = library.hylo_grouped_gemm(ctypes.byref(call), torch.cuda.current_stream(a.device).cuda_stream)
    if error:
        raise RuntimeError(
            f"{KERNEL}: launch failed with code {error} (rows {rows}, K {k}, gate_up {gate_up})"
        )


def gate_up(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    layout: Alignment,
    limit: float,
    library: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU rows h (e4m3, `[slots, I]`) and their group scales of x already in slot order
    (`kernels.gather_rows`), as `kernels._gate_up_tma_kernel` writes them; safe where `refusal` is None."""
    intermediate = weight.shape[1] // 2
    h = torch.empty(x.shape[0], intermediate, dtype=torch.float8_e4m3fn, device=x.device)
    h_scale = torch.empty(x.shape[0], intermediate // FP8_BLOCK, dtype=torch.float32, device=x.device)
    _launch(
        library or _CHECKED.ready[x.device.index],
        True,
        x,
        x_scale,
        weight,
        scale,
        layout,
        x_scale,
        h,
        h_scale,
        limit,
    )
    return h, h_scale


def down(
    h: torch.Tensor,
    h_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    layout: Alignment,
    weights: torch.Tensor,
    routed: torch.Tensor,
    library: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Each pair's weighted expert output into `routed [T·k, D]` (bf16), as `kernels._down_tma` writes it;
    safe where `refusal` is None. `weights` are the pairs' routing weights (fp32, contiguous)."""
    pair_weight = weights.float().contiguous()
    _launch(
        library or _CHECKED.ready[h.device.index],
        False,
        h,
        h_scale,
        weight,
        scale,
        layout,
        pair_weight,
        routed,
        h_scale,
        0.0,
    )
    return routed


def _self_check(library: ctypes.CDLL, device: torch.device) -> str | None:
    """Both kernels on a small routed problem against float64 products of the same e4m3 operands: 5
    experts of 256 × 512 (gate|up 2 × 256 rows), 300 pairs routed so that expert 0 holds three blocks
    (a pair of one expert, then one of two), the others one each (padding rows), and the last real block is
    alone. gate|up: h within one e4m3 step of the exact SwiGLU (the kernel's exp may round otherwise);
    down: within a bf16 rounding of the exact product of its h plus 2^-12 of the sum of its terms'
    magnitudes (the FP8 tensor cores keep ~14 bits of each 128-deep sum: the error follows the terms, not
    the result; the first check's 2^-20 of the block's largest product refused a kernel equal to the
    Triton one, RESULTS S40-3). The first failure, or None."""
    generator = torch.Generator(device=device).manual_seed(1234)
    experts, hidden, intermediate, top_k, limit = 5, 512, 256, 2, 7.0
    others = torch.randint(1, experts, (150, 1), generator=generator, device=device)
    ids = torch.cat([torch.zeros_like(others), others], 1).int()
    layout = align(ids, experts, BLOCK_M)
    slots = layout.pairs.numel()
    token = (layout.pairs.long() // top_k).clamp(0, 149)
    x = torch.randn(150, hidden, generator=generator, device=device)
    x_scale = x.abs().view(150, -1, FP8_BLOCK).amax(2) / 448
    xq = (x / x_scale.repeat_interleave(FP8_BLOCK, 1)).to(torch.float8_e4m3fn)
    a, a_scale = xq[token].contiguous(), x_scale[token].contiguous()
    w_gu = (torch.randn(experts, 2 * intermediate, hidden, generator=generator, device=device) * 16).clamp(
        -448, 448
    )
    w_gu = w_gu.to(torch.float8_e4m3fn)
    s_gu = torch.rand(experts, 2 * intermediate // FP8_BLOCK, hidden // FP8_BLOCK, generator=generator,
                      device=device) * hidden**-0.5 / 16  # fmt: skip
    w_dn = (torch.randn(experts, hidden, intermediate, generator=generator, device=device) * 16).clamp(
        -448, 448
    )
    w_dn = w_dn.to(torch.float8_e4m3fn)
    s_dn = torch.rand(experts, hidden // FP8_BLOCK, intermediate // FP8_BLOCK, generator=generator,
                      device=device) * intermediate**-0.5 / 16  # fmt: skip
    h = torch.empty(slots, intermediate, dtype=torch.float8_e4m3fn, device=device)
    h_scale = torch.empty(slots, intermediate // FP8_BLOCK, dtype=torch.float32, device=device)
    try:
        _launch(library, True, a, a_scale, w_gu, s_gu, layout, a_scale, h, h_scale, limit)
        weights = torch.rand(300, generator=generator, device=device)
        routed = torch.zeros(300, hidden, dtype=torch.bfloat16, device=device)
        _launch(library, False, h, h_scale, w_dn, s_dn, layout, weights, routed, h_scale, 0.0)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        return str(e)
    got_h, w_gu64, w_dn64 = (
        _dequant_rows(h, h_scale),
        _dequant_weights(w_gu, s_gu),
        _dequant_weights(w_dn, s_dn),
    )
    for block, (expert, rows) in enumerate(
        zip(layout.block_expert.tolist(), layout.block_rows.tolist(), strict=True)
    ):
        if expert < 0:
            continue
        mine = slice(block * BLOCK_M, block * BLOCK_M + rows)
        gate_up = _dequant_rows(a[mine], a_scale[mine]) @ w_gu64[expert].t()
        gate, up = gate_up[:, :intermediate].clamp(max=limit), gate_up[:, intermediate:].clamp(-limit, limit)
        exact_h = gate * torch.sigmoid(gate) * up
        step = exact_h.abs().view(rows, -1, FP8_BLOCK).amax(2).repeat_interleave(FP8_BLOCK, 1) / 8
        if not ((got_h[mine] - exact_h).abs() <= step).all():
            return (
                f"gate|up, block {block} (expert {expert}): h off the exact SwiGLU by more than an e4m3 step"
            )
        pair = layout.pairs[mine].long()
        exact = (got_h[mine] @ w_dn64[expert].t()) * weights.double()[pair, None]
        terms = (got_h[mine].abs() @ w_dn64[expert].abs().t()) * weights.double()[pair, None]
        error = (routed.double()[pair] - exact).abs()
        bound = 2.0**-8 * exact.abs() + 2.0**-12 * terms
        if not (error <= bound).all():
            worst = float((error / bound).max())
            return f"down, block {block} (expert {expert}): off the exact product by {worst:.3g}x its bound"
    return None


def _dequant_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(FP8_BLOCK, 1)


def _dequant_weights(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)


_CHECKED = cuda_build.checked_library(
    KERNEL, SWITCH, load_library, _self_check, "the MoE prefill runs the Triton kernels"
)
