"""The overlap schedule on the GPU: overlapped decode steps synchronise only for the one read of
their tokens, replay the decode graphs on in-flight tokens, and give the tokens of the engine that
reads every step first (batch sizes equal to graph buckets and every request ending by length, so
that both run the same kernels on the same shapes). Tiny random-weight target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import counted_read, random_prompt, with_one_read
from hf_reference import tiny_text_config

from hylo import LLM, SamplingParams
from hylo.engine.reader import PendingRead

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the overlap needs a GPU stream")

VOCAB = 160
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, min_p=0.02, seed=5, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target")
    text = {"model_type": "glm5_next_text", **tiny_text_config(4, 8)}
    (path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    return path


def cache_fraction(cache_bytes: float = 2 * 2**30) -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free + cache_bytes) / total


def make_llm(path: Path, **kwargs) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="bfloat16", load_format="dummy", page_size=16, context_length=256,
        max_running_requests=4, cuda_graph_max_bs=4, mem_fraction_static=cache_fraction(), **kwargs,
    )  # fmt: skip


def test_overlapped_steps_read_once_and_match_the_reading_engine(target, monkeypatch):
    overlapped = make_llm(target)
    reading = make_llm(target, disable_overlap_schedule=True, target=overlapped.engine.model)
    engine = overlapped.engine
    assert engine.overlap and engine.runner.graphs is not None and not reading.engine.overlap

    reads: list[int] = []
    monkeypatch.setattr(PendingRead, "wait", counted_read(PendingRead.wait, reads))
    step, replays, ahead = engine.step, [], [0]
    graphs_run = engine.runner.graphs.run

    def strict_step(plan=None):
        """A call that collects an overlapped step raises on any synchronising call but its read."""
        if engine.in_flight is None:
            return step(plan)
        outputs = with_one_read(step, reads, plan)
        ahead[0] += engine.in_flight is not None
        return outputs

    monkeypatch.setattr(engine, "step", strict_step)
    monkeypatch.setattr(
        engine.runner.graphs, "run", lambda seqs, *a: replays.append(len(seqs)) or graphs_run(seqs, *a)
    )
    for batch in (1, 2, 4):
        prompts = [random_prompt(9 + 7 * i, VOCAB, seed=80 + batch + i) for i in range(batch)]
        params = PARAMS[:batch]
        got = overlapped.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        expected = reading.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected], batch
        for mine, theirs in zip(got[0].logprobs, expected[0].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            torch.testing.assert_close(list(mine.values()), list(theirs.values()), atol=0, rtol=0)
        assert replays.count(batch) >= 20, replays
    assert len(reads) >= 60 and ahead[0] >= 60, (len(reads), ahead)


def test_steps_upload_from_pinned_memory_only(target):
    """Every host-to-device copy of an eager prefill (a KDA layer's chunked prompt among them) and of the
    decode steps after it comes from pinned memory: a pageable upload is staged by the driver, which may
    wait for the stream first (the KDA plan's offsets were one, and the TP8 rank's timeline had the GPU idle
    after it, RESULTS S48-2)."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(target, cuda_graph_max_prefill_tokens=0)
    lengths = (150, 40)
    warm = [random_prompt(n, VOCAB, seed=n) for n in lengths]
    llm.generate(prompt_token_ids=warm, sampling_params=PARAMS[0], use_tqdm=False)
    fresh = [random_prompt(n, VOCAB, seed=n + 1) for n in lengths]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=fresh, sampling_params=PARAMS[0], use_tqdm=False)
    copies = {e.name for e in prof.events() if e.name.startswith("Memcpy HtoD")}
    assert copies and not [c for c in copies if "Pageable" in c], copies
