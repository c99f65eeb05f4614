"""Host time of a speculative verify step, part by part, measured on the CPU on the embedded demo model.

On a GPU a verify step's forward, acceptance, KDA commit and next drafts are two graph replays
(`VerifyGraphs`); everything around them is host work, which the GPU waits for where a verify step is
not overlapped with the step before it (`--disable-overlap-schedule`, or rows whose acceptance needs
the host: `InFlightLedger.run_ahead`), and which runs while the GPU computes the step ahead where it is.
Here, with the overlap schedule off so that every part runs in turn, the fixed-shape verify path
runs on the CPU with that device work taken out: each bucket's first forward is kept and returned
again for every later step, and the commit graph does nothing, so a timed step is the host work alone
(scheduling, the runner outside the graphs, the graphs' metadata upload, the one read, the requests'
bookkeeping and detokenising). Acceptance is forced to the whole block (every draft accepted, as the
"forced" mode of `benchmarks/device/spec_e2e.py`), so every request commits a block a step. The
output tokens are then meaningless: only the host's time is measured.

    .venv/bin/python benchmarks/verify_host_time.py [--batches 1,8,32] [--blocks 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from hylo import LLM, SamplingParams
from hylo.engine import verify_graph
from hylo.engine.engine import Engine
from hylo.engine.runner import ModelRunner
from hylo.engine.scheduler import Scheduler
from hylo.engine.verify_graph import VerifyGraphs
from hylo.models.demo import default_model_dir

PARTS = {  # what is timed: (class, method)
    "engine_step": (Engine, "step"),
    "schedule": (Scheduler, "schedule"),
    "runner_route": (ModelRunner, "route"),
    "runner_launch": (ModelRunner, "launch"),
    "runner_collect": (ModelRunner, "collect"),
    "graphs_run": (VerifyGraphs, "run"),
    "bookkeeping": (Engine, "_apply"),
}


def timing(times: dict[str, list[float]]) -> None:
    """Wrap every part of `PARTS` so that each call appends its seconds to `times[part]`."""
    for part, (cls, name) in PARTS.items():
        method = getattr(cls, name)

        def timed(*args, _method=method, _part=part, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                times[_part].append(time.perf_counter() - start)

        setattr(cls, name, timed)


def without_device_work() -> None:
    """Each verify graph's first forward and greedy acceptance, returned again for every later step;
    no commit."""
    kept = {}
    for name in ("_forward", "_greedy"):
        original = getattr(VerifyGraphs, name)

        def kept_part(graphs: VerifyGraphs, static, *rest, _name=name, _original=original):
            key = (_name, id(graphs), id(static))
            if key not in kept:
                kept[key] = _original(graphs, static, *rest)
            return kept[key]

        setattr(VerifyGraphs, name, kept_part)
    VerifyGraphs._commit = lambda graphs, static, verified, committed, anchors: None


def accept_everything(picks, drafts, num_drafts=None):
    """Forced acceptance (in place of `accepted_prefix`, as spec_e2e.py's hook): every row keeps all of
    its drafts."""
    accepted = torch.full((picks.shape[0],), drafts.shape[1], device=picks.device)
    return accepted, (accepted + 1).int(), picks[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--blocks", type=int, default=8, help="verify steps per request")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    demo = default_model_dir()
    llm = LLM(
        str(demo), speculative_algorithm="DFLASH", speculative_draft_model_path=str(demo / "dflash"),
        speculative_adaptive=False, decode_graphs=True, device="cpu", disable_overlap_schedule=True,
    )  # fmt: skip
    block = llm.engine.proposer.verify_shape.block
    verify_graph.accepted_prefix = accept_everything
    without_device_work()
    times: dict[str, list[float]] = collections.defaultdict(list)
    timing(times)
    print(
        "| batch | host ms a verify step | schedule | runner outside the graphs | graphs' run | bookkeeping |"
    )
    print("|---|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        prompts = [[5 + i] * 64 for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=1 + block * args.blocks, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # warm-up
        rows = []
        for _ in range(args.reps):
            times.clear()
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            n = len(times["graphs_run"])  # the verify steps: the last n calls of every part
            mean = {part: sum(values[-n:]) / n * 1e3 for part, values in times.items()}
            runner = mean["runner_route"] + mean["runner_launch"] + mean["runner_collect"]
            outside = runner - mean["graphs_run"]
            parts = ("engine_step", "schedule", "graphs_run", "bookkeeping")
            rows.append((*(mean[p] for p in parts[:2]), outside, *(mean[p] for p in parts[2:])))
        cells = [statistics.median(column) for column in zip(*rows, strict=True)]
        print(f"| {batch} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
