"""Train the embedded demo target on the lent GPU: `hylo train` after checking that the KDA kernels
the reference implementation picks up (`fla-core`'s, when carried) compute what its own torch
fallback computes — the function hylo's parity tests hold hylo to. If they disagree, training runs
on the fallback.

    python3 benchmarks/device/train_demo.py --out $OUT --time-budget 400
    python3 benchmarks/device/train_demo.py --out $OUT --time-budget 400 --batch-size 256 --lr 2e-3 \
        --init-from src/hylo/assets/glm5-next-demo --work prepared/

`--init-from` continues from an earlier target's weights with a new schedule (the data, split and
tokenizer stay the demo's). `--work` may hold the encoded splits made beforehand on another machine
(`hylo.train.target.prepare`, its `.npz` recompressed with `np.savez_compressed`), so that the GPU
machine needs no ShareGPT package (its 27 MB wheel does not fit a call's carry beside the tree).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

DEMO = Path(__file__).resolve().parents[2] / "src" / "hylo" / "assets" / "glm5-next-demo"


def kda_kernel() -> str:
    """The KDA kernel training will use: the picked-up one when its loss and gradients on a small HF
    model match the torch fallback's, else the fallback."""
    import transformers.models.glm5_next.modeling_glm5_next as hf
    from hf_reference import tiny_text_config
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    picked = hf.chunk_kimi_delta_attention
    fallback = picked.__wrapped__
    vision = dict(depth=1, hidden_size=16, num_heads=1, intermediate_size=16, out_hidden_size=64,
                  projection_intermediate_size=16)  # fmt: skip
    torch.manual_seed(0)
    text = tiny_text_config(4, 64, "shared", vocab_size=300)
    config = Glm5NextConfig(text_config=text, vision_config=vision)
    model = Glm5NextForConditionalGeneration(config).cuda()
    ids = torch.randint(0, 300, (2, 200), device="cuda")
    results = []
    for kda in (picked, fallback):
        hf.chunk_kimi_delta_attention = kda
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.detach(), grads))
    hf.chunk_kimi_delta_attention = picked
    (loss_a, grad_a), (loss_b, grad_b) = results
    loss_gap = (loss_a - loss_b).abs().item()
    grad_gap = ((grad_a - grad_b).norm() / grad_b.norm()).item()
    print(f"KDA kernel {picked.__module__}: loss gap {loss_gap:.2e}, relative gradient gap {grad_gap:.2e}")
    if picked is fallback:
        return "torch fallback (transformers); no KDA package installed"
    if loss_gap < 1e-3 and grad_gap < 1e-2:
        return f"{picked.__module__} (agrees with the torch fallback)"
    hf.chunk_kimi_delta_attention = fallback
    print("the kernels disagree: training on the torch fallback")
    return "torch fallback (transformers); the installed kernel disagreed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--time-budget", type=float, default=400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--init-from", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/demo-train"))
    args = parser.parse_args()
    from hylo.train.loop import TrainSettings
    from hylo.train.target import train_target

    started = time.time()
    kernel = kda_kernel()
    settings = TrainSettings(steps=100_000, lr=args.lr, warmup=args.warmup, checkpoint_every=1000,
                             time_budget_s=args.time_budget)  # fmt: skip
    report = train_target(args.work, settings, args.batch_size, args.seq_len, device="cuda", tokenizer=DEMO,
                          init_from=args.init_from)  # fmt: skip
    report["kda_kernel"] = kernel
    report["wall_s"] = time.time() - started
    (args.work / "model" / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    for name in ("model.safetensors", "config.json", "training.json"):
        shutil.copy(args.work / "model" / name, args.out / name)
    shutil.copy(args.work / "run" / "loss.jsonl", args.out / "loss.jsonl")
    shown = ("held_out_loss", "held_out_perplexity", "parameters", "wall_s", "kda_kernel")
    print(json.dumps({k: report[k] for k in shown}))


if __name__ == "__main__":
    main()
