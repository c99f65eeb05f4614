"""Small-M GEMM: the Triton kernel against torch under the interpreter, the per-GPU table and the
dispatch that only sends tuned shapes to it."""

from __future__ import annotations

import json

import pytest
import torch
from interpreter import use_interpreter

use_interpreter()

from hylo.layers.linear import Linear  # noqa: E402
from hylo.ops import gemm  # noqa: E402
from hylo.ops.gemm import kernels, table  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 48, 80, table.GemmConfig(16, 32, 32, 1, 4, 2)),  # ragged N and K tiles
        (5, 40, 96, table.GemmConfig(16, 16, 16, 3, 4, 2)),  # split K, summed by the second launch
        (37, 24, 200, table.GemmConfig(32, 16, 32, 4, 4, 3)),  # several row blocks, last split short
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


def test_linear_layer_keeps_nn_linear_contract():
    layer = Linear(24, 40)
    assert set(layer.state_dict()) == {"weight"}
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))
    torch.testing.assert_close(gemm.linear(x, layer.weight), x @ layer.weight.t())
