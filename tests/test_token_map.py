"""Speculative token maps (`--speculative-token-map`): the file, the restricted head, and engines whose
drafts come from the map only while the outputs stay those of plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.cli import main
from hylo.config import EngineConfig
from hylo.layers.vocab import VocabHead
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS
from hylo.parallel.layout import Parallel
from hylo.speculative.token_map import coverage, hot_tokens, load_token_map, save_token_map
from hylo.tokenizer import Tokenizer

CHATS = ["What is the capital of France?", "Write a short poem about the sea."]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "no such file"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (torch.tensor([1.0, 2.0]), "integer"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([3, 100]), "must lie in [0, 100)"),
        (torch.tensor([-1, 3]), "must lie in [0, 100)"),
        (torch.tensor([4, 2, 4]), "1 token ids appear more than once"),
        ({"ids": [1, 2]}, "not a saved tensor"),
    ],
)
def test_a_bad_token_map_is_refused_naming_the_field(tmp_path, content, why):
    path = tmp_path / "map.pt"
    if isinstance(content, dict):
        path = tmp_path / "map.json"
        path.write_text("{not json")
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ValueError, match="speculative_token_map") as error:
        load_token_map(path, vocab_size=100)
    assert why in str(error.value)


def test_token_maps_round_trip_and_come_sorted(tmp_path):
    ids = torch.tensor([9, 3, 5])
    for name in ("map.pt", "map.json"):
        assert load_token_map(save_token_map(ids, tmp_path / name), 10).tolist() == [3, 5, 9]
    (tmp_path / "list.pt").write_bytes(b"")
    torch.save([7, 1], tmp_path / "list.pt")  # a plain list, as some tools save it
    assert load_token_map(tmp_path / "list.pt", 10).tolist() == [1, 7]


def test_hot_tokens_are_the_most_frequent_with_the_stop_tokens():
    sequences = [[5, 5, 5, 2, 2, 9], [2, 7, 7, 7, 7]]
    # counts: 7 ×4, 5 ×3, 2 ×3, 9 ×1; ties go to the lower id; 11 (a stop token) is always kept
    assert hot_tokens(sequences, 3).tolist() == [2, 5, 7]
    assert hot_tokens(sequences, 3, always=[11]).tolist() == [2, 7, 11]
    assert hot_tokens(sequences, 10).tolist() == [2, 5, 7, 9]
    with pytest.raises(ValueError, match="count must be >= 1"):
        hot_tokens(sequences, 0)
    assert coverage(torch.tensor([2, 7]), sequences) == 7 / 11  # three 2s and four 7s of 11 tokens
    assert coverage(torch.tensor([2]), []) == 0


def test_a_restricted_head_picks_the_best_token_of_the_map():
    torch.manual_seed(0)
    head = VocabHead(16, 50)
    with torch.no_grad():
        head.weight.normal_()
    hidden = torch.randn(6, 16)
    ids = torch.tensor([0, 3, 4, 17, 30, 49])
    hot = head.restricted(ids)
    full = head(hidden)
    expected = ids[full[:, ids].argmax(-1)]
    assert torch.equal(hot.argmax(hidden), expected)
    logits = hot(hidden)
    assert logits.shape == full.shape
    # the same 16-term fp32 dot products, but BLAS may block a 6-column product and a 50-column one
    # differently: equal to the last bits, which differ between CPUs (~1e-6 at logits of ~20 here)
    torch.testing.assert_close(logits[:, ids], full[:, ids], rtol=1e-6, atol=1e-5)
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(logits[:, outside]).all())
    # a tensor-parallel rank holding none of the map: its one row never wins the ranks' exchange
    upper = VocabHead(16, 50, Parallel(rank=1, size=2))
    assert bool(torch.isneginf(upper.restricted(ids[:3])._local_logits(hidden)).all())
    for bad in (torch.tensor([3, 3]), torch.tensor([4, 2]), torch.tensor([2, 50])):
        with pytest.raises(ValueError):
            head.restricted(bad)


def test_a_token_map_needs_a_speculative_algorithm():
    with pytest.raises(ValueError, match="speculative_token_map needs a speculative_algorithm"):
        EngineConfig(model=None, speculative_token_map="map.pt")


def _chat_prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False
        )
        for c in CHATS
    ]


def _run(prompts, **options):
    # a 0.25 GB cache: the default plan's pools took ~1 s an engine to allocate (7 engines here)
    llm = LLM(None, device="cpu", dtype="float32", speculative_adaptive=False, max_memory_gb=0.25, **options)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()
    return [o.token_ids for o in outputs], sum(o.metrics.spec_accepted_tokens for o in outputs)


@pytest.fixture(scope="module")
def plain_run() -> tuple[list[list[int]], list[list[int]]]:
    """(the chat prompts, plain decoding's tokens of them): the same engine, options and prompts in every
    parametrisation below, so decoded once per module."""
    prompts = _chat_prompts()
    return prompts, _run(prompts)[0]


@pytest.mark.parametrize(
    "spec",
    [
        dict(speculative_algorithm="MTP", speculative_num_steps=3),
        dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEMO_DRAFTS["dflash2"])),
    ],
    ids=["mtp3", "dflash2"],  # the head's argmax, and its logits (DFlash2's selector reads their top-k)
)
def test_drafts_come_from_the_map_and_outputs_stay_plain(tmp_path, spec, plain_run):
    """On the demo model: a map of the whole vocabulary drafts exactly what no map does (same accepted
    drafts); a map of every token but those plain decoding emits can never be right (nothing accepted);
    either way the tokens are plain decoding's."""
    prompts, plain = plain_run
    unrestricted, accepted = _run(prompts, **spec)
    assert unrestricted == plain and accepted > 0
    vocab = json.loads((DEMO_DIR / "config.json").read_text())["text_config"]["vocab_size"]
    everything = save_token_map(torch.arange(vocab), tmp_path / "all.pt")
    assert _run(prompts, speculative_token_map=str(everything), **spec) == (plain, accepted)
    emitted = torch.tensor(sorted({t for out in plain for t in out}))
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[emitted] = False
    others = save_token_map(torch.arange(vocab)[keep], tmp_path / "others.json")
    assert _run(prompts, speculative_token_map=str(others), **spec) == (plain, 0)


def test_token_map_command_writes_a_map_the_engine_reads(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    turns = [[{"role": "user", "content": c}, {"role": "assistant", "content": "Paris."}] for c in CHATS]
    data.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    out = tmp_path / "map.pt"
    command = ["token-map", "--model", str(DEMO_DIR), "--data", str(data), "--out", str(out)]
    assert main([*command, "--size", "40"]) == 0
    report = json.loads(capsys.readouterr().out)
    ids = load_token_map(out, 8192)
    assert report["tokens"] == len(ids) <= 40
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    assert set(tokenizer.eos_token_ids) <= set(ids.tolist())
    assert 0 < report["coverage"] <= 1
    assert main([*command, "--size", "9000"]) == 2
    assert "exceeds the vocabulary" in capsys.readouterr().err
    # default size: a quarter of the demo's 8192 tokens, from text that holds most of them
    words = [tokenizer.decode(list(range(i, i + 200))) for i in range(0, 8000, 200)]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": w}]}) + "\n" for w in words))
    assert main(command) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(load_token_map(out, 8192)) == 2048
