"""FP8 projections on the GPU: an FP8 checkpoint's block-scaled projections stay e4m3 and run the
FP8 GEMMs (the w8a16 Triton kernel for decode rows, cuBLAS's block-scaled matmul for prefill rows),
within FP8 error of the dequantised model, in eager and CUDA-graph steps alike."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Caches, random_prompt
from hf_reference import tiny_text_config

from hylo import LLM, SamplingParams
from hylo.layers.linear import Linear
from hylo.models.loader import load_model, save_checkpoint
from hylo.ops.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from hylo.ops.gemm import SCALED_MM_MIN_ROWS, fallback_config, kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 GEMMs run on a GPU")

# hidden 512 (whole groups of four 128-blocks): the projections that read the layer input go to cuBLAS
# every pool selected and every expert routed: no top-k choice that a rounding difference could flip
# (on random weights a flipped selection moves the logits far more than the FP8 rounding does)
CONFIG = tiny_text_config(
    4, 64, hidden_size=512, moe_intermediate_size=128, intermediate_size=256, linear_head_dim=32,
    num_attention_heads=8, num_key_value_heads=8, num_experts_per_tok=8, topk_group=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """Seeded random weights (`transformers` need not be there), saved block-quantised."""
    base = tmp_path_factory.mktemp("base")
    raw = {"model_type": "glm5_next", "text_config": {"model_type": "glm5_next_text", **CONFIG}}
    (base / "config.json").write_text(json.dumps(raw))
    model = load_model(base, dtype=torch.float32, progress=False, random_weights=True)
    path = tmp_path_factory.mktemp("fp8")
    save_checkpoint(model, path, raw, fp8=True)
    return path


def logits(model, ids: list[int]) -> torch.Tensor:
    caches = Caches(model)
    return caches.forward(model, [caches.chunk(0, ids, 0)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("n", "k"), [(24576, 4096), (4096, 8192), (384, 512)])
def test_fp8_kernels_match_the_dequantised_weight(n, k):
    """Both FP8 paths at model shapes against the fp32 product with the dequantised weight: the w8a16
    kernel to bf16 rounding; cuBLAS's FP8 matmul, which also quantises x per 128-group, to e4m3
    rounding of x (relative rms about 2^-4 / sqrt(3) per element)."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5)
    exact = dequantize_fp8_blocks(w, scale, torch.float32)
    for m in (1, 64, 90, 200, 1024):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        ref = x.float() @ exact.t()
        assert rel(kernels.gemm(x, w, fallback_config(m, n, k, x.device), scale), ref) < 1e-2, m
        if m >= SCALED_MM_MIN_ROWS:
            assert kernels.scaled_mm_refusal(x, w) is None
            assert rel(kernels.scaled_mm(x, w, scale), ref) < 0.05, m


def test_fp8_model_is_within_fp8_error_of_the_dequantised_one(fp8_checkpoint, monkeypatch):
    resident = load_model(fp8_checkpoint, "cuda", torch.bfloat16, progress=False)
    dequantised = load_model(fp8_checkpoint, "cuda", torch.bfloat16, progress=False, fp8_projections=False)
    fp8 = [m for m in resident.modules() if isinstance(m, Linear) and m.fp8]
    assert len(fp8) > 20 and not any(isinstance(m, Linear) and m.fp8 for m in dequantised.modules())
    paths = {"scaled_mm": 0, "gemm": 0}
    for name in paths:
        original = getattr(kernels, name)

        def counted(*a, _name=name, _original=original, **kw):
            paths[_name] += 1
            return _original(*a, **kw)

        monkeypatch.setattr(kernels, name, counted)
    # 60 rows: every projection on the w8a16 kernel, which multiplies by the exact dequantised weight
    # (fp32 products): against the fp32 model it errs no more than the bf16 model does, whose weights
    # are the dequantised ones rounded to bf16 (both keep bf16 activations)
    exact = load_model(fp8_checkpoint, "cuda", torch.float32, progress=False, fp8_projections=False)
    ids = random_prompt(60, 160, seed=4)
    reference = logits(exact, ids)
    bf16_error = rel(logits(dequantised, ids), reference)
    assert rel(logits(resident, ids), reference) < 1.25 * bf16_error
    assert paths["gemm"] > 0 and paths["scaled_mm"] == 0
    # 200 rows: the layer-input projections on cuBLAS's FP8 matmul (its activation rounding is
    # checked GEMM by GEMM above: through a random model it compounds)
    logits(resident, random_prompt(200, 160, seed=5))
    assert paths["scaled_mm"] > 0


def test_fp8_engine_decodes_like_the_dequantised_one(fp8_checkpoint):
    """Greedy tokens of the FP8 engine (decode graphs replay the w8a16 kernel) against the dequantised
    engine: the same model to FP8 rounding, so the first tokens agree and the logprobs stay close."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [random_prompt(n, 160, seed=n) for n in (7, 33, 60)]  # prefills on the w8a16 kernel
    outs = {}
    for mode in ("auto", "dequantize"):
        free, total = torch.cuda.mem_get_info()  # caches of about 4 GiB beside what is in use
        fraction = (total - free + 4 * 2**30) / total
        llm = LLM(str(fp8_checkpoint), fp8_projections=mode, page_size=16, mem_fraction_static=fraction)
        outs[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(outs["auto"], outs["dequantize"], strict=True):
        assert a.token_ids[0] == b.token_ids[0]
