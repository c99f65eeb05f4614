"""Small-M GEMM: the Triton kernel against torch under the interpreter, the per-GPU table and the
dispatch that only sends tuned shapes to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()

from hylo.layers.linear import FusedLinear, Linear  # noqa: E402
from hylo.layers.vocab import VocabHead  # noqa: E402
from hylo.ops import gemm  # noqa: E402
from hylo.ops.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402
from hylo.ops.gemm import kernels, table  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 48, 80, table.GemmConfig(16, 32, 32, 1, 4, 2)),  # ragged N and K tiles
        (5, 40, 96, table.GemmConfig(16, 16, 16, 3, 4, 2)),  # split K, summed by the second launch
        (37, 24, 200, table.GemmConfig(32, 16, 32, 4, 4, 3)),  # several row blocks, last split short
        (37, 40, 200, table.GemmConfig(16, 16, 32, 4, 4, 3, swap_ab=True)),  # transposed tiles, ragged
    ],
)
def test_gemm_matches_torch(m, n, k, config):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = kernels.gemm(x, w, config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="K=7"):
        kernels.gemm(x[:, :7], w, config)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (3, 200, 300, table.GemmConfig(16, 64, 64, 1, 4, 2)),  # ragged N and K blocks, two K tiles a block
        (21, 136, 256, table.GemmConfig(32, 32, 128, 2, 4, 2)),  # split K at a block boundary
        (21, 200, 300, table.GemmConfig(16, 64, 64, 2, 4, 2, swap_ab=True)),  # transposed tiles
    ],
)
def test_fp8_gemm_matches_the_dequantised_weight(m, n, k, config):
    """An e4m3 weight with [128, 128] block scales, read as stored: each K tile's partial product
    times its block's scale equals the product with the dequantised weight (fp32 rounding apart)."""
    gen = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=gen)
    w, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 0.05)
    expected = x @ dequantize_fp8_blocks(w, scale, torch.float32).t()
    torch.testing.assert_close(kernels.gemm(x, w, config, scale), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.linear(x, w, scale), expected, rtol=1e-6, atol=1e-6)  # CPU reference
    with pytest.raises(ValueError, match="block_k 256 must divide"):
        kernels.gemm(x, w, table.GemmConfig(16, 64, 256, 1, 4, 2), scale)
    with pytest.raises(ValueError, match="scale_inv"):
        kernels.gemm(x, w, config, scale[:, :1])


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 200, 300, table.GemmConfig(16, 64, 64, 1, 4, 2, quant_x=True)),  # ragged N and K, 64-wide groups
        (19, 136, 256, table.GemmConfig(32, 32, 128, 2, 4, 2, quant_x=True)),  # split K, 128-wide groups
        (19, 136, 256, table.GemmConfig(16, 64, 128, 2, 4, 2, quant_x=True, swap_ab=True)),  # transposed
    ],
)
def test_fp8_gemm_with_quantised_activations(m, n, k, config):
    """`quant_x`: each row's K tile of x becomes e4m3 with scale amax / 448 and meets the e4m3 weight
    on the FP8 tensor cores: the product with x so quantised and the dequantised weight, to fp32
    rounding; against the unquantised x within e4m3's rounding of x (2^-4 relative per element)."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen)
    w, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 0.05)
    exact_w = dequantize_fp8_blocks(w, scale, torch.float32)
    groups = torch.nn.functional.pad(x, (0, -k % config.block_k)).view(m, -1, config.block_k)
    x_scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    x_q = ((groups / x_scale).to(torch.float8_e4m3fn).float() * x_scale).flatten(1)[:, :k]
    got = kernels.gemm(x, w, config, scale)
    torch.testing.assert_close(got, x_q @ exact_w.t(), rtol=1e-5, atol=1e-5)
    exact = x @ exact_w.t()
    assert float((got - exact).norm() / exact.norm()) < 5e-2
    with pytest.raises(ValueError, match="quant_x"):
        kernels.gemm(x, exact_w, config)


_HOPPER_COMPILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")!r})
import torch
from code_size import compiled_launches
from hylo.ops.gemm import kernels
from hylo.ops.gemm.table import GemmConfig

x, w = torch.zeros(16, 4096, dtype=torch.bfloat16), torch.zeros(2048, 4096, dtype=torch.float8_e4m3fn)
scales = torch.ones(16, 32)
for swap in (False, True):  # the decode shape of the FP8 table: 16 rows of x, 64 weight rows, K tiles of 128
    config = GemmConfig(16, 64, 128, 1, 4, 3, swap_ab=swap)
    ptx = compiled_launches(lambda: kernels.gemm(x, w, config, scales), with_ptx=True)[0]["ptx"]
    print("wgmma.mma_async" in ptx, "mma.sync" in ptx)
"""


def test_transposed_tiles_compile_to_warpgroup_mma_for_hopper():
    """Why `swap_ab` exists: with 16 rows of x as the MMA's M side the FP8 kernel compiles to `mma.sync`;
    the transposed tile (64 weight rows as M) compiles to Hopper's warpgroup MMA. Which is faster per
    shape is measured by `benchmarks/kernels/gemm_tune.py` on the GPU."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["False", "True", "True", "False"]


def test_fp8_fused_parts_start_at_block_boundaries():
    """A fused projection made FP8 keeps each FP8 part's own block scales (parts start at 128-row
    boundaries) and computes the unquantised parts from `dense_weight`: every output is its part's
    product with the dequantised weight."""
    gen = torch.Generator().manual_seed(3)
    fused = FusedLinear(96, (("a", 40), ("b", 24), ("c", 200)))
    fused.to_fp8_(["a", "c"])
    assert fused.rows() == {"a": ("weight", 0, 40), "b": ("dense_weight", 0, 24), "c": ("weight", 128, 328)}
    parts = {name: torch.randn(n, 96, generator=gen) * 0.1 for name, n in fused.parts}
    with torch.no_grad():
        fused.weight.zero_()
        for name, (param, lo, hi) in fused.rows().items():
            if param == "weight":
                w, scale = quantize_fp8_blocks(parts[name])
                fused.weight[lo:hi] = w
                fused.weight_scale_inv[lo // 128 : -(-hi // 128)] = scale
                parts[name] = dequantize_fp8_blocks(w, scale, torch.float32)
            else:
                fused.dense_weight[lo:hi] = parts[name]
    x = torch.randn(5, 96, generator=gen)
    for out, (name, _) in zip(fused(x), fused.parts, strict=True):
        torch.testing.assert_close(out, x @ parts[name].t(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no parts named"):
        FusedLinear(96, (("a", 40),)).to_fp8_(["z"])
    with pytest.raises(ValueError, match="read as a matrix"):
        Linear(96, 40, quantizable=False).to_fp8_()


def test_table_lookup_by_gpu_and_bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "TABLES", tmp_path)
    table.load_table.cache_clear()
    cfg = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 3}
    table.table_path("NVIDIA H200").write_text(
        json.dumps({"gpu": "NVIDIA H200", "entries": {"m16_n128_k4096": {"config": cfg, "us": 1.0}}})
    )
    try:
        assert table.table_path("NVIDIA H200").name == "nvidia_h200.json"
        assert table.lookup("NVIDIA H200", 9, 128, 4096) == table.GemmConfig(**cfg)
        assert table.lookup("NVIDIA H200", 17, 128, 4096) is None  # the 32-row bucket has no entry
        assert table.lookup("NVIDIA H200", 65, 128, 4096) is None  # above the small-M range
        assert table.lookup("NVIDIA H100", 9, 128, 4096) is None  # another GPU, no table
        table.table_path("NVIDIA H100").write_text(json.dumps({"gpu": "NVIDIA H200", "entries": {}}))
        table.load_table.cache_clear()
        with pytest.raises(ValueError, match="not 'NVIDIA H100'"):
            table.lookup("NVIDIA H100", 9, 128, 4096)
    finally:
        table.load_table.cache_clear()


@pytest.mark.parametrize(
    ("rows", "n", "k", "tile_m", "tile_n", "split", "swap_ab"),
    [
        (1, 4096, 16384, 16, 64, 8, False),  # 64 output tiles on 132 SMs: K split 8 ways (512 programs)
        (17, 4096, 2048, 32, 64, 4, False),  # the split stops at 384 of K a program
        (17, 4096, 1536, 32, 64, 4, False),
        (33, 4096, 16384, 64, 64, 4, False),  # 64-row tiles: half the programs of 32-row ones
        (64, 16384, 1536, 64, 64, 1, True),  # 256 tiles: every SM has one, K whole, tiles transposed
        (8, 256, 4096, 16, 32, 8, False),  # under 1024 columns the tiles are 32 wide
        (90, 4096, 4096, 64, 64, 2, False),  # two row tiles: 128 tiles
        (16, 8192, 128, 16, 64, 1, False),  # one K block
    ],
)
def test_heuristic_config_spreads_a_small_m_product_over_the_sms(rows, n, k, tile_m, tile_n, split, swap_ab):
    config = table.heuristic_config(rows, n, k, sm_count=132)
    assert (config.block_m, config.block_n, config.split_k, config.swap_ab) == (
        tile_m,
        tile_n,
        split,
        swap_ab,
    )
    assert config.block_k == 128 and not config.quant_x


def test_a_captured_product_without_an_entry_runs_the_heuristic_configuration_or_cublas(monkeypatch):
    """Under graph capture, a shape the GPU's table lacks: an e4m3 weight (not on the CUDA GEMV here)
    and the dense part of an FP8 FusedLinear (bf16, `NARROW_MAX_N` columns or fewer) take
    `heuristic_config`; a wider dense part, and a narrow bf16 product of a bf16 model, cuBLAS (as
    eagerly: a bf16 model's graphs give its eager tokens); every result is the reference product."""
    configs = []
    original = kernels.gemm

    def recorded(x, weight, config, scale_inv=None):
        configs.append(config)
        return original(x, weight, config, scale_inv)

    monkeypatch.setattr(kernels, "gemm", recorded)
    monkeypatch.setattr(gemm, "use_kernel", lambda op, x: True)
    monkeypatch.setattr(gemm, "_gpu_name", lambda index: "a GPU without a table")
    monkeypatch.setattr(gemm, "_announce_small_m_fp8", lambda device: None)
    monkeypatch.setattr(gemm.gemv_cuda, "takes", lambda x, w, s: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 256, generator=gen)
    fp8, scale = quantize_fp8_blocks(torch.randn(1024, 256, generator=gen) * 0.1)
    exact = dequantize_fp8_blocks(fp8, scale, torch.float32)
    torch.testing.assert_close(gemm.linear(x, fp8, scale), x @ exact.t(), rtol=1e-5, atol=1e-5)
    assert configs == [table.heuristic_config(3, 1024, 256, gemm.INTERPRETER_SMS)]
    narrow = torch.randn(table.NARROW_MAX_N, 256, generator=gen)
    torch.testing.assert_close(gemm.linear(x, narrow, dense_part=True), x @ narrow.t(), rtol=1e-5, atol=1e-4)
    assert configs[1:] == [table.heuristic_config(3, table.NARROW_MAX_N, 256, gemm.INTERPRETER_SMS)]
    wide = torch.randn(table.NARROW_MAX_N + 16, 256, generator=gen)
    torch.testing.assert_close(gemm.linear(x, wide, dense_part=True), x @ wide.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemm.linear(x, narrow), x @ narrow.t(), rtol=1e-5, atol=1e-4)
    assert len(configs) == 2  # cuBLAS for both


def test_linear_layer_keeps_nn_linear_contract():
    layer = Linear(24, 40)
    assert set(layer.state_dict()) == {"weight"}
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))
    torch.testing.assert_close(gemm.linear(x, layer.weight), x @ layer.weight.t())


def test_shipped_tables_hold_only_measured_wins_for_model_shapes():
    """Every table in the package names its GPU, keys shapes of GLM-5.3-Flash's projections (bf16, and
    e4m3 as an FP8 checkpoint keeps them), and records that its configuration beat the baseline
    (cuBLAS; for `_fp8` keys the configuration without an entry when it was tuned) by the tuner's
    margin at both ends of its bucket."""
    from hylo.config import ModelConfig
    from hylo.models.glm5_next import Glm5NextForCausalLM
    from hylo.models.loader import keep_projections_fp8, stored_block_scaled

    keys = set()
    for fp8 in (False, True):
        with torch.device("meta"):
            model = Glm5NextForCausalLM(ModelConfig.from_dict({}))
            if fp8:
                keep_projections_fp8(model, stored_block_scaled)
        shapes = {
            tuple(m.weight.shape)
            for m in model.modules()
            if (isinstance(m, VocabHead) and not fp8) or (isinstance(m, Linear) and m.fp8 == fp8)
        }
        keys |= {table.entry_key(b, n, k, fp8) for b in table.M_BUCKETS for n, k in shapes}
    paths = sorted(table.TABLES.glob("*.json"))
    assert paths, "no table shipped"
    for path in paths:
        data = json.loads(path.read_text())
        assert table.table_path(data["gpu"]) == path
        assert data["entries"] and set(data["entries"]) <= keys
        for key, entry in data["entries"].items():
            config = table.GemmConfig(**entry["config"])
            assert config.split_k >= 1 and config.block_m in table.M_BUCKETS
            baseline = entry["fallback_us" if key.endswith("_fp8") else "cublas_us"]
            for rows, us in entry["us"].items():
                assert us * 1.02 <= baseline[rows]
