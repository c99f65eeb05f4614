"""End-to-end check on a GPU: the engine on CUDA (Triton kernels) against the CPU reference path,
and DFlash speculative decoding against plain decoding, on the embedded demo model.

    PYTHONPATH=src python3 benchmarks/device/gpu_smoke.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from dflash_reference import write_dflash_checkpoint

from hylo import LLM, SamplingParams
from hylo.models.demo import write_random_model


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp())
    write_random_model(model)
    vocab = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    draft = write_dflash_checkpoint(Path(tempfile.mkdtemp()), 128, vocab, [0, 3, 6], seed=1, block_size=4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 380, (n,), generator=gen).tolist() for n in (5, 17, 64, 65, 130, 300, 1, 33)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(page_size=16)
    report: dict = {}

    def run(name: str, **kwargs) -> list[list[int]]:
        llm = LLM(str(model), **common, **kwargs)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        report[f"{name}_seconds"] = time.perf_counter() - start
        if outs[0].metrics.spec_verify_steps:
            report[f"{name}_mean_tau"] = sum(o.metrics.mean_acceptance_length for o in outs) / len(outs)
        del llm
        gc.collect()
        torch.cuda.empty_cache()  # the next engine sizes its caches from the free memory
        return [o.token_ids for o in outs]

    cpu = run("cpu_fp32", device="cpu", dtype="float32", max_memory_gb=1.0)
    gpu32 = run("cuda_fp32", device="cuda", dtype="float32", mem_fraction_static=0.3)
    gpu16 = run("cuda_bf16", device="cuda", dtype="bfloat16", mem_fraction_static=0.3)
    spec16 = run(
        "cuda_bf16_dflash",
        device="cuda",
        dtype="bfloat16",
        mem_fraction_static=0.3,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(draft),
    )
    spec32 = run(
        "cuda_fp32_dflash",
        device="cuda",
        dtype="float32",
        mem_fraction_static=0.3,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(draft),
    )
    report["dflash_vs_plain_fp32_first_divergence"] = [
        first_divergence(a, b) for a, b in zip(spec32, gpu32, strict=True)
    ]
    report["dflash_vs_plain_bf16_first_divergence"] = [
        first_divergence(a, b) for a, b in zip(spec16, gpu16, strict=True)
    ]
    report["cuda_fp32_vs_cpu_first_divergence"] = [
        first_divergence(a, b) for a, b in zip(gpu32, cpu, strict=True)
    ]
    report["cuda_bf16_vs_cpu_first_divergence"] = [
        first_divergence(a, b) for a, b in zip(gpu16, cpu, strict=True)
    ]
    report["dflash_equals_plain_bf16"] = spec16 == gpu16
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out, "gpu_smoke.json").write_text(text)


if __name__ == "__main__":
    main()
