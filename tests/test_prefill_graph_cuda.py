"""Prefill chunks as CUDA-graph replays on the GPU: a replayed prefill step synchronises only for the
one read of its token, and gives the eager engine's tokens and logprobs (prompts as long as the
buckets, so that both run the same kernels on the same shapes), with and without DFlash or MTP (whose
proposer observes the chunk inside the replay), prefix-cache snapshots inside the chunk included. Tiny
random-weight target (`load_format="dummy"`)."""

from __future__ import annotations

import pytest
import torch
from conftest import counted_read, random_prompt, strict_steps
from test_speculative_cuda import VOCAB, cache_fraction, checkpoints, flags  # noqa: F401 (fixture)

from hylo import LLM, SamplingParams
from hylo.engine.reader import PendingRead

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs and the sync debug mode need a GPU"
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def make_llm(path, algorithm: str | None, draft, **kwargs) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="bfloat16", load_format="dummy", page_size=64,
        prefix_snapshot_interval=64, context_length=512, max_running_requests=2, cuda_graph_max_bs=2,
        cuda_graph_max_prefill_tokens=256, speculative_adaptive=False, mem_fraction_static=cache_fraction(),
        **(flags(algorithm, draft) if algorithm else {}), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("algorithm", [None, "dflash", "mtp"])
def test_prefill_steps_read_once_and_match_eager_steps(checkpoints, algorithm, monkeypatch):  # noqa: F811
    target, draft = checkpoints
    graphs = make_llm(target, algorithm, draft)
    eager = make_llm(target, algorithm, draft, disable_cuda_graph=True, target=graphs.engine.model)
    assert graphs.engine.runner.prefill_graphs is not None and eager.engine.runner.prefill_graphs is None
    reads, replayed = [], []
    monkeypatch.setattr(PendingRead, "wait", counted_read(PendingRead.wait, reads))
    runner = graphs.engine.runner
    run = runner.prefill_graphs.run

    def prefills(chunks) -> bool:
        return any(ch.num_tokens > 1 and not ch.verify for ch in chunks)

    # a prefill step launches without any synchronising call and is collected with none but its read
    strict_steps(
        monkeypatch,
        runner,
        reads,
        lambda chunks, route: prefills(chunks),
        lambda launched: prefills(launched.chunks),
    )
    monkeypatch.setattr(
        runner.prefill_graphs, "run", lambda seqs: replayed.append(len(seqs[0].token_ids)) or run(seqs)
    )
    # bucket-long prompts, one at a time; 128 and 256 leave snapshots inside the chunk (64, 192)
    for i, n in enumerate([16, 32, 64, 128, 256]):
        prompt = random_prompt(n, VOCAB, seed=70 + i)
        (got,) = graphs.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
        (want,) = eager.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, n
        assert got.outputs[0].logprobs[0] == want.outputs[0].logprobs[0], n  # the prefill's token
    assert replayed == [16, 32, 64, 128, 256], replayed
    assert len(reads) == 5 and all(n == 1 for n in reads), reads
    # a hit on the 256-token prompt's snapshot at 192: taken inside its chunk by the KDA kernels here,
    # by a prefill in segments in the eager engine; both compute the other 64 tokens from it
    prompt = random_prompt(256, VOCAB, seed=74)[:240] + random_prompt(16, VOCAB, seed=80)
    hits = [llm.engine.caches.prefix.stats.hit_tokens for llm in (graphs, eager)]
    (got,) = graphs.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    (want,) = eager.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    for llm, before in zip((graphs, eager), hits, strict=True):
        assert llm.engine.caches.prefix.stats.hit_tokens - before == 192
    assert replayed[-1] == 64
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs[0] == want.outputs[0].logprobs[0]
