"""The CUDA C++ FP8 GEMV (`ops/gemm/gemv_cuda.py`, `fp8_gemv.cu`) on a Hopper GPU: it builds and passes its
own check, matches the float64 product within its arithmetic's bound (`gemv_cuda.worst_error`: bf16
rounding of the output plus fp32 accumulation, against |x|·|W|) for 1-16 rows at every projection shape
of GLM-5.3-Flash, TP-rank shards and ragged shapes, in every compiled K split, under CUDA-graph capture
and replay, deterministically; `linear` routes FP8 products of up to 16 rows to it, and not with
`HYLO_FP8_GEMV=0` or where it refuses. The weights take every e4m3 code (subnormals and zeros included)
with block scales spread over 2^-12 .. 1, so a wrong byte conversion or a misplaced scale shows.

    pytest -q tests/test_fp8_gemv_cuda.py     # on the GPU machine; the first test builds the kernel (~30 s)
"""

from __future__ import annotations

import pytest
import torch

from hylo.ops import gemm
from hylo.ops.gemm import gemv_cuda

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA GEMV runs on a GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
        reason="built for Hopper only",
    ),
]

ROWS = (1, 2, 4, 8, 16)
MODEL_SHAPES = [
    (24576, 4096), (12288, 4096), (4096, 8192), (4096, 16384), (4096, 12288), (2176, 4096), (2048, 4096),
    (4096, 2048), (16384, 1536), (4096, 1536), (8192, 128), (256, 4096),
]  # fmt: skip
RANK_SHAPES = [(3072, 4096), (1536, 4096), (4096, 2048), (4096, 1024), (272, 4096), (512, 4096)]
# N or K off the 128 grid: partial row tiles, CTAs past N, a partial last k-block, K below one block
RAGGED_SHAPES = [(200, 1040), (1000, 3088), (136, 272), (72, 48), (130, 16), (1, 256), (4095, 4112)]


def problem(n: int, k: int, rows: int = 16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed + n + k)
    weight, scale = gemv_cuda.random_e4m3(n, k, gen)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    return x, weight, scale


def test_the_gemv_builds_and_passes_its_check():
    """First, so that a build or check failure reads as its reason rather than as a parity failure."""
    assert gemv_cuda.device_refusal(torch.device("cuda", torch.cuda.current_device())) is None


@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES + RANK_SHAPES + RAGGED_SHAPES)
def test_gemv_matches_the_float64_product(n, k):
    x16, weight, scale = problem(n, k)
    for m in ROWS:
        x = x16[:m]
        assert gemv_cuda.refusal(x, weight, scale) is None
        out = gemv_cuda.gemv(x, weight, scale)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        error = gemv_cuda.worst_error(out, x, weight, scale)
        assert error <= 1.0, (
            f"M={m} N={n} K={k} split {gemv_cuda.split_for(n, k, 132)}: {error:.3g}x the bound"
        )


@pytest.mark.parametrize(("n", "k"), [(2176, 4096), (4096, 1536), (4096, 8192)])
@pytest.mark.parametrize("split", gemv_cuda.SPLITS)
@pytest.mark.parametrize("slices", gemv_cuda.SLICES)
def test_every_k_split_matches(n, k, split, slices):
    x16, weight, scale = problem(n, k, seed=split)
    for m in (1, 7, 9, 16) if slices == 2 else (1, 7, 8):  # row tiles of x, each full and partial
        out = gemv_cuda.gemv(x16[:m], weight, scale, split=split, slices=slices)
        error = gemv_cuda.worst_error(out, x16[:m], weight, scale)
        assert error <= 1.0, f"M={m} split {split}, {slices} warps over K: {error:.3g}x the bound"


def test_strided_rows_of_x():
    x_wide, weight, scale = problem(1000, 3088 + 48)
    x = x_wide[:5, :3088]
    weight, scale = weight[:, :3088].contiguous(), scale[:, : -(-3088 // 128)].contiguous()
    assert x.stride(0) == 3088 + 48 and gemv_cuda.refusal(x, weight, scale) is None
    assert gemv_cuda.worst_error(gemv_cuda.gemv(x, weight, scale), x, weight, scale) <= 1.0


def test_results_are_deterministic():
    x, weight, scale = problem(4096, 16384, rows=8)  # split 4: 8 K slices summed in a fixed order
    first = gemv_cuda.gemv(x, weight, scale)
    assert all(torch.equal(first, gemv_cuda.gemv(x, weight, scale)) for _ in range(3))


def test_dependent_launches_read_what_the_kernel_before_wrote():
    """Launched as programmatic dependents (`ops.dependent_launch`), each GEMV loads its first weights
    early but reads x only once the kernel writing x has finished: a captured chain norm -> GEMV -> norm
    -> GEMV ... (every launch a dependent) equals the same chain launched plainly, bit for bit, over
    replays with fresh inputs. A GEMV that read x before its wait would read the previous replay's."""
    from hylo.ops.norm import rms_norm

    x, weight, scale = problem(4096, 4096, rows=4)
    norm_weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(rows, dependent):
        for _ in range(6):
            rows = gemv_cuda.gemv(rms_norm(rows, norm_weight, 1e-6), weight, scale, dependent=dependent)
        return rows

    static_x = x.clone()
    chain(static_x, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = chain(static_x, True)
    for seed in range(4):
        static_x.copy_(problem(4096, 4096, rows=4, seed=200 + seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, chain(static_x, False)), seed


@pytest.fixture
def gemv_calls(monkeypatch):
    """How many products `linear` sent to the GEMV."""
    calls = []
    launch = gemv_cuda.gemv
    monkeypatch.setattr(
        gemv_cuda, "gemv", lambda *args, **kw: calls.append(args[0].shape) or launch(*args, **kw)
    )
    return calls


@pytest.mark.parametrize("m", (1, 8, 16))
def test_linear_uses_the_gemv_under_graph_capture_and_replay(m, gemv_calls):
    x, weight, scale = problem(2176, 4096, rows=m)
    static_x = x.clone()
    gemm.linear(static_x, weight, scale)  # eager first (the engine warms graphs up so too)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = gemm.linear(static_x, weight, scale)
    assert len(gemv_calls) == 2
    for seed in range(3):
        fresh = problem(2176, 4096, rows=m, seed=100 + seed)[0]
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert gemv_cuda.worst_error(static_out, fresh, weight, scale) <= 1.0


def test_linear_keeps_leading_dims(gemv_calls):
    x, weight, scale = problem(1536, 4096, rows=12)
    out = gemm.linear(x.view(3, 4, 4096), weight, scale)
    assert out.shape == (3, 4, 1536) and gemv_calls == [(12, 4096)]
    assert gemv_cuda.worst_error(out.view(12, 1536), x, weight, scale) <= 1.0


def test_switch_and_refusals_keep_the_triton_kernel(monkeypatch, gemv_calls):
    x, weight, scale = problem(512, 4096, rows=17)
    assert "17 rows" in gemv_cuda.refusal(x, weight, scale)
    assert gemv_cuda.worst_error(gemm.linear(x, weight, scale), x, weight, scale) <= 1.0
    monkeypatch.setenv(gemv_cuda.SWITCH, "0")
    assert gemv_cuda.refusal(x[:4], weight, scale) == "HYLO_FP8_GEMV=0"
    assert gemv_cuda.worst_error(gemm.linear(x[:4], weight, scale), x[:4], weight, scale) <= 1.0
    assert gemv_calls == []
    x_odd, weight_odd, scale_odd = problem(64, 200, rows=2)
    monkeypatch.delenv(gemv_cuda.SWITCH)
    assert "multiple of 16" in gemv_cuda.refusal(x_odd, weight_odd, scale_odd)
