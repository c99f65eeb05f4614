"""Issue 45 item 5, "ready means ready": what the first requests after start-up cost against the same
requests repeated, in fresh processes with empty compile caches, with and without the start-up warm-up.

    PYTHONPATH=src python3 benchmarks/device/cold_start.py [--layers 4 | --demo] [--out DIR]
    PYTHONPATH=src python3 benchmarks/device/cold_start.py --dry-run      # the CPU: plumbing only

Each variant is one child process whose `TRITON_CACHE_DIR` and `HYLO_CACHE` are empty directories of
its own (Triton's kernels and hylo's CUDA C++ libraries both compile again): `warm-up` (the default
engine), `no warm-up` (`--skip-warmup`, the baseline: kernels compile at first use), and `restart`
(the default engine again over the `warm-up` child's caches: what a restart on the same machine
pays). `--variants` picks some (in order) and `--cache-root` keeps the caches where a later command
finds them: `--variants warm-up --cache-root D`, then `--variants restart --cache-root D`. A child
reports its start-up seconds (the `LLM(...)` call: load, graphs, warm-up) and the warm-up's own
seconds, then, in this order, each as a first request and then repeated with other
random tokens of the same lengths, with the Triton kernels each pair compiled (`compiled`: what the
warm-up missed):
- a batch of `--batch` short prompts (lengths 32-256, seeded) decoding `--decode` tokens each,
  submitted at once: output tokens/s;
- one prompt of each of `--prompt-lens` tokens (those the context holds): TTFT.
The acceptance (issue 45) is first / repeated <= 1.2 for each, with the warm-up. The slice is e2e.py's
(`--layers` layers of GLM-5.3-Flash, random FP8 weights); `--demo` serves the embedded demo model
(its context holds 4096 tokens: the long prompts are skipped). On the CPU nothing compiles, so
`--dry-run` (the demo model, small shapes) checks the plumbing, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = {"warm-up": [], "no warm-up": ["--skip-warmup"], "restart": []}
SHORT = (32, 256)  # a short prompt's length range


def child(args: argparse.Namespace) -> dict:
    """One fresh engine (in this process): its start-up and its first and repeated requests."""
    from hylo import LLM

    cuda = not args.dry_run
    kwargs = dict(device="cuda" if cuda else "cpu", skip_warmup=args.skip_warmup)
    if args.dry_run:
        kwargs |= dict(dtype="float32", max_memory_gb=0.5, chunked_prefill_size=256, max_running_requests=8)
    elif args.demo:
        kwargs |= dict(mem_fraction_static=0.5)
    else:
        path = Path(tempfile.mkdtemp()) / "target"
        path.mkdir()
        sys.path.insert(0, str(Path(__file__).parent))
        from spec_e2e import write_target

        write_target(path, args.layers)
        free, total = torch.cuda.mem_get_info()
        weights = 41e9 * args.layers / 8  # the slice's FP8 weights (RESULTS S15-3)
        fraction = (total - free + weights + 16e9) / total  # the weights and 16 GB of caches
        kwargs |= dict(
            model=str(path), load_format="dummy", context_length=max(args.prompt_lens) + 64,
            max_running_requests=max(args.batch, 8), mem_fraction_static=fraction,
        )  # fmt: skip
    start = time.perf_counter()
    llm = LLM(**kwargs)
    out = {"startup_s": time.perf_counter() - start, "warmup_s": llm.engine.memory_report["warmup_seconds"]}
    compiled = CompileLog()
    engine, gen = llm.engine, torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    lengths = torch.randint(SHORT[0], SHORT[1] + 1, (args.batch,), generator=gen).tolist()
    rates = [served(engine, [random(n, vocab, gen) for n in lengths], args.decode) for _ in range(2)]
    out["batch"] = figures([sum(len(r.output_ids) for r in reqs) / s for reqs, s in rates], higher=True)
    out["batch"]["compiled"] = compiled.take()
    for n in args.prompt_lens:
        if n + 1 >= engine.context_len:
            continue
        ttfts = [ttft(served(engine, [random(n, vocab, gen)], 1)[0][0]) for _ in range(2)]
        out[f"prompt_{n}"] = figures([t * 1e3 for t in ttfts], higher=False)
        out[f"prompt_{n}"]["compiled"] = compiled.take()
    return out


class CompileLog:
    """The Triton kernels compiled in this process from its making on (Triton's post-compile hook: a kernel
    loaded from the disk cache counts too, as it also costs its first launch); `take()` returns the
    names compiled since the last call. What a first request compiled is what the warm-up missed."""

    def __init__(self):
        import triton

        self.names: list[str] = []
        triton.knobs.runtime.jit_post_compile_hook = self.hook

    def hook(self, *, fn, **_) -> bool:
        self.names.append(fn.name)
        return False

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def random(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def served(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """Submit every prompt at once, step until all finish: (requests, seconds)."""
    from hylo import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    served.count += 1
    start = time.perf_counter()
    requests = [engine.add_request(f"r{served.count}-{i}", p, params)[0] for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return requests, time.perf_counter() - start


served.count = 0


def ttft(request) -> float:
    return request.metrics.first_token_time - request.metrics.arrival_time


def figures(first_and_repeat: list[float], higher: bool) -> dict:
    """A first measure and its repeat, and how much worse the first is (first / repeat for a time,
    repeat / first for a rate: > 1 is slower)."""
    first, repeat = first_and_repeat
    return {
        "first": round(first, 2),
        "repeat": round(repeat, 2),
        "slowdown": round(repeat / first if higher else first / repeat, 3),
    }


def run_variant(name: str, caches: Path, argv: list[str]) -> dict:
    """The variant's child process over the compile caches under `caches` (empty unless reused)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), HYLO_CACHE=str(caches / "hylo"))
    command = [sys.executable, __file__, "--child", *argv, *VARIANTS[name]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"error": done.stderr[-4000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--demo", action="store_true", help="the embedded demo model instead of the slice")
    parser.add_argument(
        "--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072]
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode", type=int, default=64, help="tokens each prompt of the batch decodes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which variants to run, in order")
    parser.add_argument(
        "--cache-root", default=None, help="where the variants' compile caches go (default: a new temp dir)"
    )
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.demo, args.prompt_lens, args.batch, args.decode = True, [300, 1000], 4, 4
    if args.child:
        print(json.dumps(child(args)))
        return
    passed = ["--layers", str(args.layers), "--prompt-lens", ",".join(map(str, args.prompt_lens))]
    passed += ["--batch", str(args.batch), "--decode", str(args.decode)]
    passed += ["--demo"] * args.demo + ["--dry-run"] * args.dry_run
    root = Path(args.cache_root) if args.cache_root else Path(tempfile.mkdtemp(prefix="cold_start_"))
    report = {"gpu": None if args.dry_run else torch.cuda.get_device_name(), "argv": passed}
    for name in args.variants.split(","):
        caches = root / ("warm-up" if name == "restart" else name.replace(" ", "-"))
        report[name] = run_variant(name, caches, passed)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cold_start.json").write_text(text)


if __name__ == "__main__":
    main()
