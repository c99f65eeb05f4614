"""The shared expert inside the routed experts' decode launches, on the GPU: one GLM-5.3-Flash MoE layer
(hylo's `MoE`: 288 routed experts, top-8, D 4096, I 2048, one shared expert; FP8 block-scaled or bf16
weights) at decode sizes, as CUDA-graph replays.

- `folded`: `MoE.forward` as it runs, the shared expert one more pair per token of the routed
  experts' three launches (`moe_ops.shared_refusal` must be None here, else the script stops);
- `apart`: the shared expert as its own MLP (gate|up GEMM, activation, down GEMM through the GEMM
  dispatch, so the tuned table under capture), its output the routed launches' addend: six launches;
- `shared_mlp`: that MLP alone; `floor`: the weight bytes a step reads (its distinct routed experts and
  the shared expert, scales included) at the copy rate measured in the same run.

Each timed call cycles through 4 batches routed to different experts, so the routed weights come from
HBM; the shared expert's come from wherever the previous batch left them in both variants alike.

    python benchmarks/kernels/moe_shared.py [--out DIR]
    python benchmarks/kernels/moe_shared.py --dry-run   # CPU, Triton interpreter, tiny sizes, fake timers

Writes `moe_shared.json` to --out (default $OUT or ./out) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from interpreter import use_interpreter

    use_interpreter()

from harness import RESULTS, bench_graph, rec, section  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.config import ModelConfig  # noqa: E402
from hylo.layers.moe import FP8Experts, MoE  # noqa: E402
from hylo.ops import moe as moe_ops  # noqa: E402
from hylo.ops.fp8 import FP8_BLOCK  # noqa: E402

DEV = "cpu" if DRY else "cuda"
# the interpreter's bf16 dot is wrong: the dry run's "bf16" path runs on fp32
ACT = torch.float32 if DRY else torch.bfloat16
HIDDEN, INTER, EXPERTS, TOP_K = (128, 128, 16, 4) if DRY else (4096, 2048, 288, 8)
TOKENS = (1, 4, 8)
ROTATE = 4


def forced_use_kernel(op, tensor, verify=None, **log_names) -> bool:
    """The dry run's dispatch: as for CUDA tensors (the verifier decides), the kernels interpreted."""
    return verify is None or verify() is None


def fill_(t: torch.Tensor, scale: float) -> None:
    """Random values of about `scale`, written a slice at a time (bounded fp32 temporaries)."""
    for chunk in t.split(16):
        chunk.copy_(torch.randn(chunk.shape, device=DEV) * scale)


def moe_layer(fp8: bool) -> MoE:
    """One MoE layer of random weights in `ACT`, its routed experts and shared MLP FP8 where asked (e4m3
    of random values with block scales near 1/√K, so that outputs stay of order one)."""
    one_moe_layer = {
        "layer_types": ["linear_attention"],
        "mlp_layer_types": ["sparse"],
        "indexer_types": ["full"],
    }
    config = ModelConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=1, **one_moe_layer,
    )  # fmt: skip
    with torch.device("meta"):
        moe = MoE(config).to(ACT)
    moe.gate.to_empty(device=DEV)
    moe.shared_experts.to_empty(device=DEV)
    fill_(moe.gate.weight.data, HIDDEN**-0.5)
    if fp8:
        moe.experts = FP8Experts.empty(config, DEV)
        for linear in (moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj):
            linear.to_fp8_()
        weights = [
            (moe.experts.gate_up_proj, moe.experts.gate_up_proj_scale_inv),
            (moe.experts.down_proj, moe.experts.down_proj_scale_inv),
            (moe.shared_experts.gate_up_proj.weight, moe.shared_experts.gate_up_proj.weight_scale_inv),
            (moe.shared_experts.down_proj.weight, moe.shared_experts.down_proj.weight_scale_inv),
        ]
        for weight, scale in weights:
            fill_(weight.data, 1.0)
            scale.fill_(weight.shape[-1] ** -0.5)
    else:
        moe.experts.to_empty(device=DEV)
        for weight in (moe.experts.gate_up_proj, moe.experts.down_proj, *moe.shared_experts.parameters()):
            fill_(weight.data, weight.shape[-1] ** -0.5)
    moe.gate.e_score_correction_bias = torch.zeros(EXPERTS, device=DEV)
    return moe.requires_grad_(False)


def bytes_read(moe: MoE, ids: torch.Tensor, fp8: bool) -> int:
    """Weight bytes of a step: its distinct routed experts and the shared expert (+ block scales)."""
    per_expert = 3 * INTER * HIDDEN * (1 if fp8 else 2)
    if fp8:
        per_expert += 4 * 3 * (INTER // FP8_BLOCK) * (HIDDEN // FP8_BLOCK)
    return (int(ids.unique().numel()) + 1) * per_expert


def copy_rate() -> None:
    """Bytes read + written per second by a 1 GiB device copy (the floor's rate)."""
    src = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = bench_graph(lambda: dst.copy_(src))
    rec("copy_TBps", round(2 * src.numel() / us / 1e6, 3))


def decode(fp8: bool) -> None:
    tag = "fp8" if fp8 else "bf16"
    moe = moe_layer(fp8)
    rate = RESULTS["copy_TBps"] * 1e12
    for tokens in TOKENS:
        gen = torch.Generator(device=DEV).manual_seed(tokens)
        xs = [torch.randn(tokens, HIDDEN, device=DEV, generator=gen).to(ACT) for _ in range(ROTATE)]
        refusal = moe_ops.shared_refusal(xs[0], TOP_K, moe.experts.weights, moe.shared_expert())
        if refusal is not None:
            raise RuntimeError(f"the shared expert does not fold here: {refusal}")
        folded = [moe(x) for x in xs]
        apart = [moe.routed(x, addend=moe.shared_experts(x)) for x in xs]
        diff = max(
            float((a.float() - b.float()).norm() / b.float().norm())
            for a, b in zip(folded, apart, strict=True)
        )
        rec(f"{tag}_T{tokens}_folded_vs_apart_rel_err", round(diff, 5))
        ids = [moe_ops.route(x, moe.routing).ids for x in xs]
        floor = sum(bytes_read(moe, i, fp8) for i in ids) / rate * 1e6 / ROTATE
        rec(f"{tag}_T{tokens}_floor_us", round(floor, 2))
        variants = {
            "folded": lambda xs=xs: [moe(x) for x in xs],
            "apart": lambda xs=xs: [moe.routed(x, addend=moe.shared_experts(x)) for x in xs],
            "shared_mlp": lambda xs=xs: [moe.shared_experts(x) for x in xs],
        }
        for name, fn in variants.items():
            rec(f"{tag}_T{tokens}_{name}_us", round(bench_graph(fn) / ROTATE, 2))


def table() -> None:
    print("\n| weights, tokens | folded (3 launches) | apart (6) | shared MLP alone | floor |")
    print("|---|---|---|---|---|")
    for tag in ("fp8", "bf16"):
        for tokens in TOKENS:
            key = f"{tag}_T{tokens}"
            if f"{key}_apart_us" in RESULTS:
                print(
                    f"| {tag}, {tokens} | {RESULTS[f'{key}_folded_us']} us | {RESULTS[f'{key}_apart_us']} us "
                    f"| {RESULTS[f'{key}_shared_mlp_us']} us | {RESULTS[f'{key}_floor_us']} us |"
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if DRY:
        moe_ops.use_kernel = forced_use_kernel
    else:
        rec("gpu", torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    section("copy_rate", copy_rate)
    with torch.inference_mode():
        for fp8 in (True, False):
            section(f"decode_{'fp8' if fp8 else 'bf16'}", decode, fp8)
            (out / "moe_shared.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    table()


if __name__ == "__main__":
    main()
