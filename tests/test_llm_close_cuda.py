"""Closing an `LLM` gives its GPU memory back (issue 47): engines built, run and closed one after
another, with CUDA graphs (decode and prefill; verify graphs with MTP and DFlash), leave
`torch.cuda.memory_allocated()` where it was before them. It grew by ~0.1 GiB an engine: each engine
captured its graphs on streams of its own, and PyTorch keeps a cuBLAS workspace (32 MiB on Hopper)
for every stream a matmul ran on, for the life of the process (`engine.cuda_graph.capture_stream`)."""

from __future__ import annotations

import gc

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory needs a GPU")

PROMPTS = ["The quick brown fox", "The quick brown fox jumps over", "Hello", "Tell me a story"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PLAIN: dict = {}
MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
DFLASH = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(DEMO_DRAFTS["dflash"])}


def build_run_close(settings: dict) -> None:
    free, total = torch.cuda.mem_get_info()
    llm = LLM(
        str(DEMO_DIR), device="cuda", page_size=16, context_length=512, max_running_requests=4,
        cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=64,
        mem_fraction_static=(total - free + 2**30) / total,  # 1 GiB of caches beside what is in use
        **settings,
    )  # fmt: skip
    engine = llm.engine
    assert engine.runner.graphs is not None and engine.runner.graphs.bank.graphs  # captured
    assert (engine.runner.verify_graphs is not None) == bool(settings)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    llm.close()


def live_blocks() -> dict[int, dict]:
    """The allocator's blocks in use, by address (with the Python stack that allocated each, while
    the memory history is recorded)."""
    segments = torch.cuda.memory._snapshot()["segments"]
    return {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}


def describe(blocks: list[dict]) -> str:
    lines = []
    for b in sorted(blocks, key=lambda b: -b["size"])[:8]:
        frames = b.get("frames", [])
        ours = [f for f in frames if "/hylo/" in f["filename"] or "/tests/" in f["filename"]] or frames
        where = " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in ours[:4])
        lines.append(f"{b['size'] / 2**20:.2f} MiB from {where or '?'}")
    return "; ".join(lines)


def test_closed_llms_give_back_their_gpu_memory():
    # What a process keeps once, however many engines follow: the cuBLAS workspaces of the default
    # stream and of the one capture stream, MoE decode's ticket counters, the CUDA generator's graph
    # state. An engine of each kind takes them.
    for settings in (PLAIN, MTP, DFLASH):
        build_run_close(settings)
    gc.collect()
    before, blocks_before = torch.cuda.memory_allocated(), live_blocks()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        for i, settings in enumerate([PLAIN, MTP, DFLASH, PLAIN, DFLASH]):
            build_run_close(settings)  # no collection here: `close` gives the memory back itself
            after = torch.cuda.memory_allocated()
            new = [b for a, b in live_blocks().items() if a not in blocks_before]
            assert after == before, (
                f"engine {i} ({settings.get('speculative_algorithm', 'plain')}) left "
                f"{(after - before) / 2**20:.2f} MiB: {describe(new)}"
            )
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
