"""Checkpoint loading: layouts, FP8 block-scaled weights, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from allocation_meter import AllocationMeter, largest_fp32_bytes
from conftest import Caches, random_prompt
from fastapi.testclient import TestClient
from hf_reference import tiny_text_config, write_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hylo.config import EngineConfig, ModelConfig
from hylo.engine.builder import budget_bytes
from hylo.engine.engine import Engine
from hylo.layers.moe import FP8Experts, MoE
from hylo.memory.manager import CacheManager, LoadPeak, weight_bytes
from hylo.models.loader import (
    CheckpointError,
    _quantizable,
    checkpoint_layout,
    dequantize_fp8,
    load_model,
    save_checkpoint,
)
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.server.api import build_app
from hylo.server.async_engine import AsyncEngine

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("base"), tiny_text_config(4, 8), seed=11)


def copy_with(base: Path, dest: Path, edit) -> Path:
    """A copy of `base` whose tensors went through `edit(dict) -> dict`."""
    shutil.copytree(base, dest)
    tensors = edit(load_file(base / WEIGHTS))
    save_file(tensors, str(dest / WEIGHTS))
    return dest


def logits(model, ids):
    caches = Caches(model)
    return caches.forward(model, [caches.chunk(0, ids, 0)])


def load(path):
    return load_model(path, dtype=torch.float32, progress=False)


def test_missing_tensor_is_named(base, tmp_path):
    key = "model.language_model.layers.1.self_attn.indexer.wk.weight"
    path = copy_with(base, tmp_path / "c", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(
        CheckpointError, match=r"missing.*layers\.1\.self_attn\.indexer\.wk\.weight \(16, 64\)"
    ):
        load(path)


def test_unexpected_tensor_is_named_with_its_file(base, tmp_path):
    path = copy_with(
        base, tmp_path / "c", lambda t: t | {"model.language_model.layers.0.bogus.weight": torch.ones(2)}
    )
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: unexpected tensor .*layers\.0\.bogus\.weight"
    ):
        load(path)


def test_misshaped_tensor_names_expected_shape(base, tmp_path):
    key = "model.language_model.layers.4.mlp.experts.5.up_proj.weight"
    path = copy_with(base, tmp_path / "c", lambda t: t | {key: torch.ones(31, 64)})
    with pytest.raises(
        CheckpointError, match=r"experts\.5\.up_proj\.weight.*\(31, 64\), expected \(32, 64\)"
    ):
        load(path)


def test_corrupt_file_and_missing_shard_are_reported(base, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(base, corrupt)
    (corrupt / WEIGHTS).write_bytes((base / WEIGHTS).read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(corrupt)
    sharded = tmp_path / "sharded"
    shutil.copytree(base, sharded)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "missing.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"missing\.safetensors"):
        load(sharded)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((base / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load(empty)


def test_fp8_weight_without_scale_is_rejected(base, tmp_path):
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    path = copy_with(base, tmp_path / "c", lambda t: t | {key: t[key].to(torch.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_scale_inv"):
        load(path)


def test_sharded_flat_layout_with_skipped_tensors_loads_identically(base, tmp_path):
    """Text-only `model.layers.*` names, two shards + index, MTP layer and vision tensors present."""
    tensors = load_file(base / WEIGHTS)
    flat = {k.replace("model.language_model.", "model."): v for k, v in tensors.items() if "visual" not in k}
    flat["model.layers.6.eh_proj.weight"] = torch.ones(3, 3)  # the MTP layer (num_hidden_layers = 6)
    flat["model.layers.6.shared_head.norm.weight"] = torch.ones(3)
    flat["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(3)
    path = tmp_path / "flat"
    path.mkdir()
    keys = sorted(flat)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    for name, part in shards.items():
        save_file({k: flat[k] for k in part}, str(path / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    text = json.loads((base / "config.json").read_text())["text_config"]
    (path / "config.json").write_text(json.dumps(text | {"model_type": "glm5_next"}))
    ids = random_prompt(23, 160, seed=5)
    torch.testing.assert_close(logits(load(path), ids), logits(load(base), ids), rtol=0, atol=0)


def test_fp8_checkpoint_round_trip(tmp_path):
    base = write_hf_checkpoint(tmp_path / "base", tiny_text_config(4, 8), seed=12, gain=0.3)
    model = load(base)
    raw = json.loads((base / "config.json").read_text())
    save_checkpoint(model, tmp_path / "fp8", raw, fp8=True)
    with safe_open(str(tmp_path / "fp8" / WEIGHTS), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safetensors handle is not iterable)
    assert dtypes["model.language_model.layers.4.mlp.experts.0.gate_proj.weight"] == "F8_E4M3"
    assert dtypes["model.language_model.layers.4.mlp.experts.0.gate_proj.weight_scale_inv"] == "F32"
    assert dtypes["model.language_model.layers.1.self_attn.kv_b_proj.weight"] == "F8_E4M3"
    fp8 = load(tmp_path / "fp8")

    # exactly the model whose weights went through block quantisation in memory
    expected = load(base)
    params = dict(expected.named_parameters()) | dict(expected.named_buffers())
    for key, slot in checkpoint_layout(expected).items():
        view = slot.view(params[slot.param].data)
        if _quantizable(key, view.reshape(slot.shape)):
            view.copy_(
                dequantize_fp8(*quantize_fp8_blocks(view.reshape(slot.shape)), torch.float32).view(view.shape)
            )
    ids = random_prompt(41, 160, seed=6)
    exact, got = logits(model, ids), logits(fp8, ids)
    torch.testing.assert_close(got, logits(expected, ids), rtol=1e-5, atol=1e-5)

    # and within FP8 error of bf16: e4m3 rounds each weight by up to 2^-4 of itself
    bf16 = load(base)
    for p in bf16.parameters():
        p.data = p.data.to(torch.bfloat16).float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    fp8_err, bf16_err = rel(got, exact), rel(logits(bf16, ids), exact)
    assert fp8_err < 0.03 and bf16_err < 0.01


def test_quantize_fp8_blocks():
    """Each block's largest magnitude maps to e4m3's 448; every weight is off by at most half a step
    (2^-4 of itself for normals, 2^-10 of the block scale for subnormals)."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 200)
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert q.float().abs()[:128, :128].max().item() == 448
    back = dequantize_fp8(q, scale, torch.float32)
    per_weight = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    bound = torch.maximum(w.abs() / 16, per_weight * 2**-10) * (1 + 1e-6)
    assert bool(((back - w).abs() <= bound).all())


def test_config_rejects_shared_layer_without_full_predecessor():
    text = tiny_text_config(4, 8, indexer_types=["full", "full", "full", "full", "shared", "shared"])
    text["layer_types"] = [
        "linear_attention",
        "indexed_attention",
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "indexed_attention",
    ]
    with pytest.raises(ValueError, match=r"indexer_types\[5\] is 'shared' but layer 4"):
        ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text})


def test_config_rejects_other_model_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path / "nowhere")


def test_default_schedules_match_glm5_flash():
    config = ModelConfig.from_dict({"model_type": "glm5_next"})
    assert len(config.kda_layers) == 34 and config.dsa_layers == list(range(3, 45, 4))
    assert config.mlp_layer_types[:4] == ["dense", "dense", "dense", "sparse"]
    assert config.row_width == 2048 + 15


def test_fp8_experts_stay_fp8_in_memory(tmp_path):
    """`fp8_experts` keeps the routed experts' e4m3 weights and block scales as the checkpoint has them;
    the model computes what the dequantised-at-load model computes."""
    base = write_hf_checkpoint(
        tmp_path / "base", tiny_text_config(4, 8, moe_intermediate_size=128), seed=13, gain=0.3
    )
    raw = json.loads((base / "config.json").read_text())
    save_checkpoint(load(base), tmp_path / "fp8", raw, fp8=True)
    dequantised = load(tmp_path / "fp8")
    resident = load_model(tmp_path / "fp8", dtype=torch.float32, progress=False, fp8_experts=True)
    experts = [layer.mlp.experts for layer in resident.layers if isinstance(layer.mlp, MoE)]
    assert experts and all(isinstance(e, FP8Experts) for e in experts)
    assert experts[0].gate_up_proj.dtype == torch.float8_e4m3fn
    with safe_open(str(tmp_path / "fp8" / WEIGHTS), "pt") as f:
        prefix = "model.language_model.layers.4.mlp.experts.2"
        up, up_scale = (
            f.get_tensor(f"{prefix}.up_proj.weight"),
            f.get_tensor(f"{prefix}.up_proj.weight_scale_inv"),
        )
    layer4 = resident.layers[4].mlp.experts
    assert torch.equal(layer4.gate_up_proj[2, 128:].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(layer4.gate_up_proj_scale_inv[2, 1:], up_scale)
    ids = random_prompt(37, 160, seed=8)
    torch.testing.assert_close(logits(resident, ids), logits(dequantised, ids), rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="moe_intermediate_size to be a multiple of 128, got 32"):
        small = write_hf_checkpoint(tmp_path / "small", tiny_text_config(4, 8), seed=14)
        load_model(small, dtype=torch.float32, progress=False, fp8_experts=True)
    with pytest.raises(CheckpointError, match="FP8 experts need e4m3"):
        load_model(base, dtype=torch.float32, progress=False, fp8_experts=True)


def test_fp8_projections_stay_fp8_in_memory(tmp_path):
    """`fp8_projections` keeps every projection the checkpoint stores block-scaled in e4m3 with its
    scales, fused parts each from a 128-row boundary and the unquantised indexer head weights in a
    dense second part; the absorbed kv_b stays in the model dtype. The model computes what the
    dequantised-at-load model computes, and saving writes the checkpoint's tensors back bit for bit."""
    config = tiny_text_config(4, 8, linear_head_dim=32)  # q, k, v: 128 rows each, b: 4 (split by head)
    base = write_hf_checkpoint(tmp_path / "base", config, seed=15, gain=0.3)
    raw = json.loads((base / "config.json").read_text())
    save_checkpoint(load(base), tmp_path / "fp8", raw, fp8=True)
    dequantised = load(tmp_path / "fp8")
    resident = load_model(tmp_path / "fp8", dtype=torch.float32, progress=False, fp8_projections=True)
    kda, dsa = resident.layers[0].self_attn, resident.layers[1].self_attn
    assert kda.in_proj.weight.dtype == kda.o_proj.weight.dtype == torch.float8_e4m3fn
    assert kda.in_proj.rows() == {
        "q_proj": ("weight", 0, 128), "k_proj": ("weight", 128, 256), "v_proj": ("weight", 256, 384),
        "f_a_proj": ("weight", 384, 416), "g_a_proj": ("weight", 512, 544), "b_proj": ("dense_weight", 0, 4),
    }  # fmt: skip
    assert tuple(kda.in_proj.weight_scale_inv.shape) == (5, 1)
    assert dsa.in_proj.rows()["q_a_proj"] == ("weight", 0, 48)
    assert not dsa.in_proj.weight[48:128].float().any()  # the rows between parts are zeros
    assert dsa.in_proj.rows()["indexer.wk"] == ("weight", 256, 272)
    assert dsa.in_proj.rows()["indexer.weights_proj"] == ("dense_weight", 0, 16)
    assert dsa.in_proj.dense_weight.dtype == dsa.kv_b_proj.weight.dtype == torch.float32
    with safe_open(str(tmp_path / "fp8" / WEIGHTS), "pt") as f:
        key = "model.language_model.layers.0.self_attn.k_proj.weight"
        k_proj, k_scale = f.get_tensor(key), f.get_tensor(key + "_scale_inv")
    assert torch.equal(kda.in_proj.weight[128:256].view(torch.uint8), k_proj.view(torch.uint8))
    assert torch.equal(kda.in_proj.weight_scale_inv[1:2], k_scale)
    ids = random_prompt(37, 160, seed=9)
    torch.testing.assert_close(logits(resident, ids), logits(dequantised, ids), rtol=1e-5, atol=1e-5)

    save_checkpoint(resident, tmp_path / "again", raw, fp8=True)
    again, stored = load_file(tmp_path / "again" / WEIGHTS), load_file(tmp_path / "fp8" / WEIGHTS)
    assert again.keys() == stored.keys()
    for name, tensor in stored.items():
        same = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
        held = again[name].view(torch.uint8) if again[name].dtype == torch.float8_e4m3fn else again[name]
        if "kv_b_proj" not in name:  # kv_b was dequantised at load and is quantised again
            assert torch.equal(held, same), name


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compress_gate_is_a_part_of_the_dsa_in_proj(base, tmp_path, fp8):
    """The indexer's k-pool compress gate reads the layer input as q_a, kv_a, wk and weights_proj do:
    its rows are the last part of the DSA layer's `in_proj` (their one GEMM; in an FP8 model the dense
    GEMM beside the unquantised weights_proj), not a parameter of its own. Checkpoints keep it as the
    bare parameter `...indexer.index_kpool_compress_gate`: loading fills the rows from it, and a
    save -> load -> save round trip writes it back bit for bit."""
    raw = json.loads((base / "config.json").read_text())
    save_checkpoint(load_model(base, progress=False), tmp_path / "stored", raw, fp8=fp8)
    model = load_model(tmp_path / "stored", progress=False, fp8_projections=fp8)
    in_proj = model.layers[1].self_attn.in_proj
    assert not [name for name, _ in model.named_parameters() if name.endswith("compress_gate")]
    param, lo, hi = in_proj.rows()["indexer.index_kpool_compress_gate"]
    assert param == ("dense_weight" if fp8 else "weight") and hi == getattr(in_proj, param).shape[0]
    key = "model.language_model.layers.1.self_attn.indexer.index_kpool_compress_gate"
    stored = load_file(tmp_path / "stored" / WEIGHTS)
    assert stored[key].dtype == torch.bfloat16 and stored[key].shape == (hi - lo, in_proj.in_features)
    assert torch.equal(getattr(in_proj, param)[lo:hi], stored[key])

    save_checkpoint(model, tmp_path / "again", raw, fp8=fp8)
    again = load_file(tmp_path / "again" / WEIGHTS)
    assert again.keys() == stored.keys() and torch.equal(again[key], stored[key])


def test_dummy_load_needs_only_the_config(tmp_path):
    """`load_format="dummy"` builds a model from config.json alone with seeded random weights (FP8
    experts included), the same on every load, finite logits; a bad load_format names the field."""
    text = tiny_text_config(4, 8, moe_intermediate_size=128) | {"model_type": "glm5_next_text"}
    raw = {"model_type": "glm5_next", "text_config": text, "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    first, second = (
        load_model(tmp_path, dtype=torch.float32, progress=False, fp8_experts=True, random_weights=True)
        for _ in range(2)
    )
    experts = first.layers[4].mlp.experts
    assert isinstance(experts, FP8Experts) and experts.gate_up_proj.float().std() > 0.5
    assert (experts.gate_up_proj_scale_inv > 0).all()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        ), name
    out = logits(first, random_prompt(9, 160, seed=2))
    assert torch.isfinite(out).all() and out.std() > 0
    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        EngineConfig(load_format="pt")


@pytest.mark.parametrize("random_weights", [False, True], ids=["checkpoint", "dummy"])
def test_loading_holds_the_weights_and_one_tensor_more(base, random_weights):
    """Parameters are allocated in their final dtype and filled one tensor at a time: while loading
    bf16 weights, nothing beyond them but one fp32 tensor (a checkpoint tensor, or a slice of random
    noise) is ever alive. Allocating the model in fp32 first and casting holds twice the weights."""
    with AllocationMeter() as meter:
        model = load_model(base, dtype=torch.bfloat16, progress=False, random_weights=random_weights)
    weights = weight_bytes(model)
    assert meter.peak <= weights + largest_fp32_bytes(model) < 1.5 * weights
    kda = model.layers[0].self_attn
    assert model.embed_tokens.weight.dtype == kda.in_proj.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == kda.dt_bias.dtype == torch.float32  # kept fp32, as transformers does


def test_tied_embeddings_are_one_tensor(tmp_path):
    text = tiny_text_config(4, 8) | {"model_type": "glm5_next_text", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    model = load_model(tmp_path, dtype=torch.float32, progress=False, random_weights=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = {id(p): p for m in model.modules() for p in m._parameters.values() if p is not None}
    assert weight_bytes(model) == sum(p.nbytes for p in untied.values()) + sum(
        b.nbytes for b in model.buffers()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures PyTorch's CUDA allocator")
@pytest.mark.parametrize("random_weights", [False, True], ids=["checkpoint", "dummy"])
def test_cuda_load_peak_is_the_weights(base, random_weights):
    """On the GPU a checkpoint's tensors are read and converted on the host: the peak is the weights
    (1.05x leaves room for the allocator's rounding); random init adds one fp32 slice at a time."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with LoadPeak(device) as peak:
        model = load_model(base, device, torch.bfloat16, progress=False, random_weights=random_weights)
    weights = weight_bytes(model)
    bound = weights + largest_fp32_bytes(model) if random_weights else 1.05 * weights
    assert weights <= peak.bytes <= bound, (peak.bytes, weights)


def test_engine_reports_its_memory(base, caplog):
    """The start-up report: the weights, what the caches really allocate, the admission limits; the
    CUDA allocator's figures are absent on the CPU. It is logged and served by /server_info."""
    config = EngineConfig(model=str(base), device="cpu", dtype="bfloat16", page_size=16, max_memory_gb=0.05)
    with caplog.at_level(logging.INFO, logger="hylo"):
        engine = Engine(config)
    report = engine.memory_report
    assert report["weights_bytes"] == weight_bytes(engine.model) > 0
    with AllocationMeter() as meter:
        caches = CacheManager(engine.model.config, engine.plan, engine.dtype, engine.device)
        assert report["cache_bytes"] == meter.live_bytes <= config.max_memory_gb * 2**30
    assert report["max_total_num_tokens"] == engine.plan.max_total_num_tokens == caches.pages.size * 16
    assert report["max_running_requests"] == caches.slots.size > 0
    assert {report[k] for k in ("load_peak_bytes", "torch_allocated_bytes", "torch_reserved_bytes")} == {None}
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    gib = report["weights_bytes"] / 2**30
    assert f"weights={gib:.2f}GiB load_peak=n/a" in line
    assert f"max_total_num_tokens={report['max_total_num_tokens']}" in line
    info = TestClient(build_app(AsyncEngine(engine), "m")).get("/server_info").json()
    assert info["memory"] == report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures PyTorch's CUDA allocator")
def test_cuda_budget_counts_freed_blocks_as_free(base):
    """Blocks freed after loading stay reserved by PyTorch's cache, and `mem_get_info` counts them as
    in use: the budget must count them as free (and the report shows the allocator's figures)."""
    config = EngineConfig(model=str(base), device="cuda", mem_fraction_static=0.1, page_size=16)
    engine = Engine(config, decode_graphs=False)
    report = engine.memory_report
    assert report["load_peak_bytes"] >= report["weights_bytes"] > 0
    assert report["torch_reserved_bytes"] >= report["torch_allocated_bytes"] >= report["cache_bytes"]
    staging = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    del staging
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert held >= 2**30
    budget = budget_bytes(config, engine.device)
    assert budget >= free - total * (1 - config.mem_fraction_static) + held - 2**20
