"""Speculative steps on the GPU: a verify step that replays its CUDA graph synchronises only for the
one read of its tokens, and the replayed steps give the eager engine's tokens (batch sizes equal to
graph buckets, so that both run the same kernels on the same shapes). Tiny random-weight target
(`load_format="dummy"`), a tiny random DFlash draft and the target's dummy MTP layer."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from conftest import counted_read, random_prompt, strict_steps, with_one_read
from dflash_reference import write_dflash_checkpoint
from hf_reference import tiny_text_config

from hylo import LLM, SamplingParams
from hylo.engine.graph_bank import GraphBank
from hylo.engine.reader import PendingRead, Reader, StepRead
from hylo.speculative.token_map import save_token_map

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs and the sync debug mode need a GPU"
)

VOCAB, HIDDEN, BLOCK = 160, 64, 4
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# sampled rows verify between the two graphs of a step: a seeded row, one on the engine's generator
SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, min_p=0.02, max_tokens=24, ignore_eos=True),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(a config-only target directory with a token map of every other id, a DFlash draft for it)."""
    target = tmp_path_factory.mktemp("target")
    text = {"model_type": "glm5_next_text", **tiny_text_config(4, 8)}
    (target / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    save_token_map(torch.arange(0, VOCAB, 2), target / "token_map.pt")
    draft = write_dflash_checkpoint(
        tmp_path_factory.mktemp("draft"), HIDDEN, VOCAB, [0, 2, 4], seed=5, block_size=BLOCK
    )
    return target, draft


def flags(algorithm: str, draft: Path) -> dict:
    if algorithm == "mtp":
        return {"speculative_algorithm": "MTP", "speculative_num_steps": BLOCK - 1}
    return {
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": str(draft),
        "speculative_num_draft_tokens": BLOCK,
    }


def cache_fraction(cache_bytes: float = 4 * 2**30) -> float:
    """The `mem_fraction_static` that leaves an engine about `cache_bytes` of caches beside what is in
    use now (a tiny model's weights, the other engines of the module)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free + cache_bytes) / total


def make_llm(path: Path, algorithm: str, draft: Path, **kwargs) -> LLM:
    """`algorithm` NAME_map: NAME drafting from the target directory's token map. No prefill graphs:
    a prompt they take drafts nothing and decodes its anchor alone next (`Request.undrafted`), a step
    the eager engine does not run, and bf16 forwards of other shapes part by an ulp and then by a
    greedy near-tie (tests/test_prefill_graph_cuda.py compares that path with eager steps)."""
    if algorithm.endswith("_map"):
        algorithm = algorithm.removesuffix("_map")
        kwargs["speculative_token_map"] = str(path / "token_map.pt")
    return LLM(
        str(path), device="cuda", dtype="bfloat16", load_format="dummy", page_size=16,
        context_length=256, max_running_requests=4, cuda_graph_max_bs=4, speculative_adaptive=False,
        cuda_graph_max_prefill_tokens=0, **flags(algorithm, draft), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("algorithm", "sampling"),
    [
        ("dflash", "greedy"),
        ("mtp", "greedy"),
        ("dflash", "sampled"),
        ("mtp", "sampled"),
        ("mtp_map", "greedy"),
    ],
)
def test_verify_steps_read_once_and_match_eager_steps(checkpoints, algorithm, sampling, monkeypatch):
    """Verify steps, read at once (sampled rows) or overlapped with the next (greedy rows), synchronise
    only for their one read, replay the graphs and give the eager engine's tokens."""
    target, draft = checkpoints
    graphs = make_llm(target, algorithm, draft, mem_fraction_static=cache_fraction())
    eager = make_llm(
        target, algorithm, draft, mem_fraction_static=cache_fraction(), disable_cuda_graph=True,
        target=graphs.engine.model,
    )  # fmt: skip
    assert graphs.engine.runner.verify_graphs is not None and eager.engine.runner.verify_graphs is None

    reads, replayed = [], []
    # the one read of a step read at once, and of an overlapped one (counted in strict steps only: the
    # eager engine's steps read too)
    monkeypatch.setattr(PendingRead, "wait", counted_read(PendingRead.wait, reads))
    runner = graphs.engine.runner
    run = runner.verify_graphs.run
    # a verify step read at once launches without any synchronising call and is collected with none
    # but its one read
    strict_steps(
        monkeypatch, runner, reads,
        lambda chunks, route: not route.ahead and all(ch.verify for ch in chunks),
        lambda launched: not launched.route.ahead and launched.verifies,
    )  # fmt: skip
    engine = graphs.engine
    engine_step = engine.step

    def strict_engine_step(plan=None):
        """A call that collects an overlapped verify step (greedy rows: launched before the step ahead
        of it was read) raises on any synchronising call but that step's read."""
        if engine.in_flight is None or not engine.in_flight.verifies:
            return engine_step(plan)
        return with_one_read(engine_step, reads, plan)

    monkeypatch.setattr(engine, "step", strict_engine_step)
    monkeypatch.setattr(
        runner.verify_graphs, "run", lambda seqs, *rest: replayed.append(len(seqs)) or run(seqs, *rest)
    )
    for batch in (1, 2, 4):  # graph buckets: no filler blocks
        prompts = [random_prompt(9 + 7 * i, VOCAB, seed=60 + batch + i) for i in range(batch)]
        params = GREEDY if sampling == "greedy" else [SAMPLED[i % 2] for i in range(batch)]
        got = graphs.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        expected = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected], batch
        if sampling == "sampled":
            # a block cut short at the token limit runs padded in the graph, unpadded eagerly: the
            # bf16 logits may then part by an ulp (~1e-2 at these magnitudes)
            for mine, theirs in zip(got[0].logprobs, expected[0].logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                torch.testing.assert_close(list(mine.values()), list(theirs.values()), atol=2e-2, rtol=0)
        assert replayed.count(batch) >= 3, replayed
    assert len(reads) >= 9 and all(n == 1 for n in reads), reads


def test_greedy_speculative_tokens_are_plain_decodings(checkpoints):
    """Greedy DFlash and MTP engines (eager verify steps) give plain decoding's tokens: the KDA block
    verify (T tokens in one chunk) agrees with the decode step's recurrence closely enough that no argmax
    moves. With its tl.dot in plain tf32 two of these five prompts parted on an H100 (RESULTS S31-2)."""
    target, draft = checkpoints
    plain = LLM(
        str(target), device="cuda", dtype="bfloat16", load_format="dummy", page_size=16, context_length=256,
        max_running_requests=4, disable_cuda_graph=True, mem_fraction_static=cache_fraction(),
    )  # fmt: skip
    prompts = [
        random_prompt(n, VOCAB, seed=s) for n, s in ((16, 70), (32, 71), (64, 72), (48, 73), (100, 74))
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # one prompt a step, as the speculative engines below run them: a batched prefill's bf16 GEMMs may
    # round otherwise and move an argmax of these random weights (seen on an H200)
    want = [
        plain.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0].token_ids
        for p in prompts
    ]
    for algorithm in ("dflash", "mtp"):
        llm = make_llm(
            target, algorithm, draft, mem_fraction_static=cache_fraction(), disable_cuda_graph=True,
            target=plain.engine.model,
        )  # fmt: skip
        got = [llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0] for p in prompts]
        assert [o.token_ids for o in got] == want, algorithm
        llm.close()


def test_one_read_keeps_results_of_one_shape_apart():
    """A step reads the sampled tokens and a verify step's accepted counts together; of one shape and
    dtype, each still gets its own pinned buffer."""
    tokens, accepted = torch.tensor([5, 6], device="cuda"), torch.tensor([1, 2], device="cuda")
    got = Reader().read(StepRead(tokens=tokens, accepted=accepted))
    assert got.tokens.tolist() == [5, 6] and got.emitted is None and got.accepted.tolist() == [1, 2]


def test_graphs_are_captured_with_the_collector_off(checkpoints, monkeypatch):
    """Every bucket's capture (decode and verify graphs) runs with the garbage collector off, and the
    collector is back on afterwards: a collection mid-capture could free an earlier engine's graphs
    or pinned buffers, whose CUDA calls would invalidate the capture."""
    target, draft = checkpoints
    seen, capture = [], GraphBank._capture

    def recorded(self, *args):
        seen.append((self.shape.kind, gc.isenabled()))
        return capture(self, *args)

    monkeypatch.setattr(GraphBank, "_capture", recorded)
    assert gc.isenabled()
    make_llm(target, "dflash", draft, mem_fraction_static=cache_fraction(2**30))
    assert {kind for kind, _ in seen} >= {"decode", "verify"}
    assert not any(enabled for _, enabled in seen) and gc.isenabled()
