"""The DFlash / DFlash2 draft's projections: every one a hylo `Linear` (so `ops.gemm.linear`, the tuned
dispatch under CUDA-graph capture, sees it), one GEMM for a block's q|k|v and one for gate|up, and the
z-lab checkpoint format unchanged by the fusion (load -> save bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_reference import write_dflash_checkpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hylo.layers.linear
import hylo.models.dflash
from hylo.layers.linear import FusedLinear, Linear
from hylo.models.dflash import DFlashConfig, DFlashDraftModel
from hylo.models.loader import load_flat
from hylo.train.dflash import save_draft

HIDDEN, VOCAB, BLOCK, TARGET_LAYERS = 64, 160, 4, [0, 2, 4]
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def checkpoint(request, tmp_path_factory):
    options = DFLASH2 if request.param == "dflash2" else None
    return write_dflash_checkpoint(
        tmp_path_factory.mktemp(request.param), HIDDEN, VOCAB, TARGET_LAYERS, seed=5, block_size=BLOCK,
        dflash2=options,
    )  # fmt: skip


def loaded(path, dtype=torch.float32) -> DFlashDraftModel:
    model = DFlashDraftModel(DFlashConfig.from_dir(path)).to(dtype)
    load_flat(model, path)
    return model.eval()


def test_every_projection_is_a_hylo_linear_and_one_input_is_one_gemm(checkpoint):
    model = loaded(checkpoint)
    plain = [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Linear)
    ]
    assert plain == []
    for layer in model.layers:
        assert isinstance(layer.self_attn.qkv_proj, FusedLinear)
        assert [name for name, _ in layer.self_attn.qkv_proj.parts] == ["q_proj", "k_proj", "v_proj"]
        assert [name for name, _ in layer.mlp.gate_up_proj.parts] == ["gate_proj", "up_proj"]


class MatmulCount(TorchDispatchMode):
    """aten matrix products of two matrices (a projection's GEMM; attention's batched products are bmm)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_block_and_the_context_run_one_dispatched_gemm_per_fused_projection(checkpoint, monkeypatch):
    """The block path's GEMMs per layer, in order, each through `ops.gemm.linear` and each one product:
    (DFlash2: the attention conv's kernel projection) q|k|v, o, (the MLP conv's) gate|up, down; the
    context's: fc once, then each layer's k|v rows."""
    model = loaded(checkpoint)
    names = {id(p): name.removesuffix(".weight") for name, p in model.named_parameters()}
    calls = []

    def recording(gemm):
        def record(x, weight, scale_inv=None):
            owner = weight if weight._base is None else weight._base
            rows = "" if weight._base is None else f"[{weight.shape[0]} rows]"
            calls.append(names[id(owner)] + rows)
            return gemm(x, weight, scale_inv)

        return record

    for module in (hylo.layers.linear, hylo.models.dflash):
        monkeypatch.setattr(module, "linear", recording(module.linear))
    c = model.config
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 7, len(TARGET_LAYERS) * HIDDEN, generator=gen)
    block = torch.randn(2, BLOCK, HIDDEN, generator=gen)
    ctx_pos = torch.arange(7).expand(2, -1)
    positions = 7 + torch.arange(BLOCK).expand(2, -1)
    counter = MatmulCount()
    with torch.no_grad(), counter:
        ctx_kv = model.context_kv(features, ctx_pos)
        model(block, positions, ctx_kv, ctx_pos, torch.ones_like(ctx_pos, dtype=torch.bool))
    kv_rows = 2 * c.num_key_value_heads * c.head_dim
    context = ["fc"] + [f"layers.{i}.self_attn.qkv_proj[{kv_rows} rows]" for i in range(c.num_hidden_layers)]
    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    if c.dflash2 is not None:
        per_layer.insert(0, "attention_conv.kernel_projection")
        per_layer.insert(3, "mlp_conv.kernel_projection")
    blocks = [f"layers.{i}.{name}" for i in range(c.num_hidden_layers) for name in per_layer]
    assert calls == context + blocks
    assert counter.count == len(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_z_lab_checkpoint_loads_and_saves_bit_for_bit(checkpoint, dtype, tmp_path):
    """The fused parts are loaded from and saved to the z-lab names, row for row."""
    model = loaded(checkpoint, dtype)
    config = json.loads((checkpoint / "config.json").read_text())
    save_draft(model, config, tmp_path, dtype=dtype)
    original, saved = (
        load_file(str(checkpoint / "model.safetensors")),
        load_file(str(tmp_path / "model.safetensors")),
    )
    assert sorted(saved) == sorted(original)
    assert "layers.1.self_attn.k_proj.weight" in saved and "layers.1.mlp.up_proj.weight" in saved
    for name, tensor in original.items():
        assert saved[name].dtype == dtype and torch.equal(saved[name], tensor.to(dtype)), name
    rows = model.layers[1].self_attn.qkv_proj.rows()
    _, lo, hi = rows["k_proj"]
    assert torch.equal(
        model.layers[1].self_attn.qkv_proj.weight[lo:hi],
        original["layers.1.self_attn.k_proj.weight"].to(dtype),
    )
