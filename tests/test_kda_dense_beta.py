"""A KDA decode step whose β logits come as `LowRank(x, W_b)`: the layer input x `[B, hidden]` and b_proj's
rows `W_b [H, hidden]` in x's dtype (an FP8 checkpoint's b_proj, kept apart from the e4m3 GEMM), each
head's logit computed inside the step kernel as a dot product of the hidden size, against the reference
(`reference.decode`, which computes `x @ W_bᵀ` first), under the Triton interpreter; then the FP8 KDA
layer's decode with and without that GEMM.

Errors are rms(out - ref) / rms(ref), as in test_kda_low_rank.py. fp32 inputs: the logits differ from the
reference's only in the order of fp32 sums (relative ~2^-24 · sqrt(hidden)), which moves o and S by far
less than the 3e-6 bound. bf16 inputs: the step rounds to bf16 what the reference rounds there too (the
conv outputs, the gate products, the logits, o before the norm, the output) from sums that differ in
their last fp32 bits, so a few entries of each differ by one bf16 step (2^-8 relative): the bound is
four such steps, 2^-6 (the step with b multiplied out first is 5.5e-3 from the reference at this shape,
already over the 5e-3 FLA uses for fp16, whose step is 2^-11).
"""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import Caches, random_prompt  # noqa: E402
from hf_reference import tiny_text_config  # noqa: E402
from test_kda_low_rank import DecodeState, err  # noqa: E402

from hylo.ops import kda as kda_ops  # noqa: E402
from hylo.ops.fp8 import quantize_fp8_blocks  # noqa: E402
from hylo.ops.kda import KDAInputs, LowRank, recurrent, reference  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("strict_launch_arguments"),
]

RATIO = 3e-6
RATIO_BF16 = 2**-6


class Step(DecodeState):
    """A decode step whose β logits are `LowRank(x, W_b)` with x of `hidden` columns; with `fp8_gates` its f
    and norm gate are rank-d factors with e4m3 projections (as the FP8 layer gives them), else dense
    tensors."""

    def __init__(self, seed: int, dtype, hidden: int, h: int, d: int, batch: int, fp8_gates: bool):
        super().__init__(seed, dtype, h, d, batch)
        hd = h * d
        self.q, self.k, self.v = self.randn(batch, 3 * hd).split([hd] * 3, dim=-1)
        # logits of order 1, where σ is steepest: x @ W_bᵀ with W_b ~ hidden^-1/2
        self.b = LowRank(
            self.randn(batch, hidden), self.randn(h, hidden, dtype=torch.float32).mul(hidden**-0.5).to(dtype)
        )
        if fp8_gates:
            f_a, g_a = self.randn(batch, 2 * d).split([d, d], dim=-1)
            self.f, self.gate = (
                LowRank(a, *quantize_fp8_blocks(self.randn(hd, d, dtype=torch.float32) * d**-0.5))
                for a in (f_a, g_a)
            )
        else:
            self.f, self.gate = self.randn(batch, hd), self.randn(batch, h, d)

    def run(self, decode, dense_b: bool = False):
        """(o, conv pool, state pool) after `decode` of this step, with b multiplied out first when
        `dense_b`."""
        x = KDAInputs(self.q, self.k, self.v, self.f, self.b.dense() if dense_b else self.b)
        return self.step(decode, x, self.gate)


@pytest.mark.parametrize(
    ("dtype", "hidden", "h", "batch", "fp8_gates", "bound"),
    [
        # hidden 1100: two whole row steps of 512 and a ragged one of 76; dense gates
        (torch.float32, 1100, 3, 3, False, RATIO),
        # with the FP8 layer's low-rank gates beside it; one ragged step (hidden below ROW_STEP)
        (torch.float32, 300, 2, 3, True, RATIO),
        (torch.bfloat16, 1100, 3, 2, True, RATIO_BF16),
    ],
)
def test_dense_beta_decode_matches_reference(dtype, hidden, h, batch, fp8_gates, bound):
    """Several heads (each its own row of W_b) and sequences (each its own row of x); d = 32 gives two
    value tiles per head, every one of which computes the head's logit."""
    step = Step(21 + hidden, dtype, hidden, h, 32, batch, fp8_gates)
    o_ref, conv_ref, state_ref = step.run(reference.decode)
    o, conv, state = step.run(recurrent.decode)
    assert err(o, o_ref) < bound
    assert err(state, state_ref) < bound
    assert torch.equal(conv, conv_ref)  # the windows are copies
    o_dense, _, state_dense = step.run(recurrent.decode, dense_b=True)  # b multiplied out first
    assert err(o, o_dense) < bound and err(state, state_dense) < bound


def test_dense_beta_decode_is_two_launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    seen, run = [], InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs.get("B_RANK")))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    Step(1, torch.float32, 300, 2, 32, 1, fp8_gates=True).run(recurrent.decode)
    assert seen == [("_recurrent_kernel", 300), ("_gated_norm_kernel", None)]


def test_many_head_rows_multiply_beta_out_first(monkeypatch):
    """Beyond `LOW_RANK_MAX_HEAD_ROWS` (sequence, head) pairs b is the projection's product
    (`ops.gemm.linear`, here the CPU's torch), read dense by the step kernel: the same step."""
    monkeypatch.setattr(recurrent, "LOW_RANK_MAX_HEAD_ROWS", 3)  # 2 sequences x 2 heads = 4 > 3
    step = Step(8, torch.float32, 300, 2, 32, 2, fp8_gates=True)
    o_ref, conv_ref, state_ref = step.run(reference.decode)
    from triton.runtime.interpreter import InterpretedFunction

    ranks, run = [], InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        ranks.append(kwargs.get("B_RANK"))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    o, conv, state = step.run(recurrent.decode)
    assert err(o, o_ref) < RATIO and err(state, state_ref) < RATIO and torch.equal(conv, conv_ref)
    assert ranks[0] == 0  # the step kernel read b dense


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: LowRank(b.a, b.weight[:-1]), r"weight must be a contiguous \[2, 300\]"),
        (lambda b: LowRank(b.a, *quantize_fp8_blocks(b.weight)), "β's LowRank weight must be unscaled"),
    ],
)
def test_dense_beta_refuses_factors_that_do_not_fit(change, message):
    step = Step(2, torch.float32, 300, 2, 32, 2, fp8_gates=False)
    step.b = change(step.b)
    with pytest.raises(ValueError, match=message):
        step.run(recurrent.decode)


# ---- the FP8 KDA layer: b's GEMM left out of a decode step ----------------------------------------------

# one KDA layer with a dense MLP; q, k, v 128 rows each (whole e4m3 blocks), b 4 rows (dense)
LAYER_CONFIG = tiny_text_config(
    4, 8, linear_head_dim=32, num_hidden_layers=1, layer_types=["linear_attention"],
    indexer_types=["full"], mlp_layer_types=["dense"],
)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_layer_model(tmp_path_factory):
    from hylo.models.loader import load_model

    path = tmp_path_factory.mktemp("fp8_kda")
    raw = {"model_type": "glm5_next", "text_config": {"model_type": "glm5_next_text", **LAYER_CONFIG}}
    (path / "config.json").write_text(json.dumps(raw))
    return load_model(path, dtype=torch.float32, random_weights=True, fp8_projections=True)


def layer_decode(model, monkeypatch, b_apart: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the KDA layer's output in a decode step of two sequences after their prefills, the weights of
    every projection product it ran), the decode's KDA ops on the Triton kernels (interpreted); with
    `b_apart` False the layer is made to take b from its projection's dense GEMM as before."""
    attention = model.layers[0].self_attn
    assert attention.in_proj.rows()["b_proj"] == ("dense_weight", 0, 4)
    caches = Caches(model, num_seqs=2, per_seq=32)
    prompts = [random_prompt(n, LAYER_CONFIG["vocab_size"], seed=n) for n in (5, 9)]
    caches.forward(model, [caches.chunk(i, p, 0) for i, p in enumerate(prompts)])
    with monkeypatch.context() as patch:
        patch.setattr(kda_ops, "use_kernel", lambda *args, **kwargs: True)
        if not b_apart:
            patch.setattr(type(attention), "_b_rows_apart", lambda self: None)
        from hylo.layers import linear as linear_module

        weights, linear = [], linear_module.linear
        patch.setattr(
            linear_module, "linear", lambda x, w, s=None, **kw: weights.append(w) or linear(x, w, s, **kw)
        )
        outputs = []
        hook = attention.register_forward_hook(lambda m, args, out: outputs.append(out[0]))
        try:
            caches.forward(model, [caches.chunk(i, [7 + i], len(p)) for i, p in enumerate(prompts)])
        finally:
            hook.remove()
    return outputs[0], weights


def test_fp8_layer_decode_leaves_out_the_b_gemm(fp8_layer_model, monkeypatch):
    """The FP8 layer's decode runs no GEMM of b_proj's rows (they go into the step kernel) and gives the
    output of the layer that runs it, up to fp32 sum order (module docstring)."""
    fused, fused_weights = layer_decode(fp8_layer_model, monkeypatch, b_apart=True)
    unfused, unfused_weights = layer_decode(fp8_layer_model, monkeypatch, b_apart=False)
    dense = fp8_layer_model.layers[0].self_attn.in_proj.dense_weight
    assert any(w is dense for w in unfused_weights)
    assert not any(w is dense for w in fused_weights)
    assert len(fused_weights) == len(unfused_weights) - 1
    assert err(fused, unfused) < RATIO
