"""The one rule every op family's dispatcher follows (`hylo.ops.dispatch.use_kernel`), and the
verifiers that say why a kernel refuses a call."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from hylo.config import ModelConfig
from hylo.models.glm5_next import model_refusals
from hylo.ops import dispatch, mhc, norm, sparse_mla
from hylo.ops.kda import chunked_prefill_refusal, device_offsets_refusal


def test_cuda_calls_take_the_kernel_unless_its_verifier_refuses(caplog):
    on_gpu = SimpleNamespace(is_cuda=True)  # what the rule reads of a tensor
    asked = []
    assert not dispatch.use_kernel("test.op", torch.zeros(1), lambda: asked.append(1))
    assert not asked  # off CUDA the reference runs, and the verifier is not asked
    assert dispatch.use_kernel("test.op", on_gpu) and dispatch.use_kernel("test.op", on_gpu, lambda: None)
    with caplog.at_level(logging.INFO, logger="hylo"):
        for _ in range(3):
            assert not dispatch.use_kernel("test.op", on_gpu, lambda: "too wide")
    assert dispatch.refusals()["test.op", "too wide"] == 3
    logged = [r.getMessage() for r in caplog.records if "test.op" in r.getMessage()]
    assert logged == ["test.op: the Triton kernel refuses this call (too wide); the torch reference runs it"]


def test_verifiers_name_the_reason():
    assert "power-of-two rank" in sparse_mla.refusal(torch.zeros(4, 24))
    assert sparse_mla.refusal(torch.zeros(4, 512)) is None
    assert "hc_mult 3: the kernels unroll 4 streams" in mhc.refusal(torch.zeros(2, 3, 8))
    assert "unsupported dtype" in mhc.refusal(torch.zeros(2, 4, 8, dtype=torch.float64))
    assert mhc.refusal(torch.zeros(2, 4, 8)) is None
    assert "unit last stride" in norm.refusal(torch.zeros(8, 4).t(), torch.ones(8))
    assert "safe gate" in chunked_prefill_refusal(None) and chunked_prefill_refusal(-5.0) is None
    assert device_offsets_refusal(torch.device("cpu"), None) is None
    assert "safe gate" in device_offsets_refusal(torch.device("cuda"), 0.5)


def test_a_model_the_kernels_cannot_take_is_named_at_start_up():
    """Named limits checked on the configuration: which ops would run the torch reference on the GPU."""
    assert model_refusals(ModelConfig.from_dict({})) == {}
    odd = SimpleNamespace(hc_mult=2, kv_lora_rank=192, linear_lower_bound=None, hidden_size=20480)
    assert set(model_refusals(odd)) == {"mhc", "sparse_mla", "kda.prefill", "norm.rms_norm"}
