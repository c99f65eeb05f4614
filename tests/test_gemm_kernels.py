"""Small-M GEMM: the Triton kernel against torch under the interpreter, the per-GPU table and the
dispatch that only sends tuned shapes to it."""

from __future__ import annotations

import json

import pytest
import torch
from interpreter import use_interpreter

use_interpreter()

from hylo.layers.linear import Linear  # noqa: E402
from hylo.layers.vocab import VocabHead  # noqa: E402
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


def test_shipped_tables_hold_only_measured_wins_for_model_shapes():
    """Every table in the package names its GPU, keys shapes of GLM-5.3-Flash's projections, and records
    that its configuration beat cuBLAS by the tuner's margin at both ends of its bucket."""
    from hylo.config import ModelConfig
    from hylo.models.glm5_next import Glm5NextForCausalLM

    with torch.device("meta"):
        model = Glm5NextForCausalLM(ModelConfig.from_dict({}))
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, (Linear, VocabHead))}
    keys = {table.entry_key(b, n, k) for b in table.M_BUCKETS for n, k in shapes}
    paths = sorted(table.TABLES.glob("*.json"))
    assert paths, "no table shipped"
    for path in paths:
        data = json.loads(path.read_text())
        assert table.table_path(data["gpu"]) == path
        assert data["entries"] and set(data["entries"]) <= keys
        for entry in data["entries"].values():
            config = table.GemmConfig(**entry["config"])
            assert config.split_k >= 1 and config.block_m in table.M_BUCKETS
            for rows, us in entry["us"].items():
                assert us * 1.02 <= entry["cublas_us"][rows]
