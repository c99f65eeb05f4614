"""`hylo train-draft` end to end on the CPU: a tiny target regenerates the answers, hylo captures its
features, the draft trains (loss falls), and the exported draft serves through hylo's speculative
decoding with the plain engine's greedy tokens; a killed run resumes to the same loss curve."""

from __future__ import annotations

import json

import pytest
from hf_reference import tiny_text_config, write_hf_checkpoint

from hylo import LLM, SamplingParams
from hylo.cli import main
from hylo.speculative.token_map import load_token_map
from hylo.train import loop
from hylo.train.bpe import train_tokenizer

WORDS = ["red", "green", "blue", "one", "two", "three", "cat", "dog", "sun", "moon", "tree", "stone"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random target with a trained chat tokenizer (mask token included), and prompts."""
    path = tmp_path_factory.mktemp("target")
    lines = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(8)) for i in range(200)]
    tokenizer = train_tokenizer(lines, path, vocab_size=300)
    write_hf_checkpoint(
        path,
        tiny_text_config(4, 8, "shared", vocab_size=tokenizer.vocab_size, pad_token_id=0),
        seed=5,
        gain=0.5,
    )
    conversations = path / "prompts.jsonl"
    conversations.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": line}]}) + "\n" for line in lines[:16])
    )
    return path, conversations


def _train(target_dir, prompts, out, algorithm, steps=24, *extra) -> list[float]:
    args = ["train-draft", "--target", str(target_dir), "--algorithm", algorithm, "--data", str(prompts)]
    args += ["--out", str(out), "--num-prompts", "12", "--max-tokens", "12", "--steps", str(steps)]
    args += ["--warmup", "2", "--lr", "1e-2", "--batch-size", "6", "--device", "cpu", "--no-progress"]
    assert main([*args, *extra]) == 0
    return [json.loads(line)["loss"] for line in (out / "run" / loop.LOSS_LOG).read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2", "mtp"])
def test_train_draft_learns_and_the_draft_serves_losslessly(target, tmp_path, algorithm):
    target_dir, prompts = target
    extra = () if algorithm == "mtp" else ("--block-size", "4", "--num-layers", "1")
    if algorithm == "dflash2":  # features from the first and the last target layer, and a token map
        extra += ("--target-layers", "0,3", "--token-map-size", "16")
    losses = _train(target_dir, prompts, tmp_path, algorithm, 30, *extra)
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["data"]["prompts"] == 12 and report["data"]["response_tokens"] > 0
    if algorithm == "dflash2":
        saved = json.loads((tmp_path / "model" / "config.json").read_text())
        assert saved["dflash_config"]["target_layer_ids"] == [0, 3]
        assert report["token_map"]["tokens"] == 16 and 0 < report["token_map"]["answer_coverage"] <= 1
        assert len(load_token_map(tmp_path / "model" / "token_map.pt", 300)) == 16

    if algorithm == "mtp":  # the layer goes beside the target's weights
        served = tmp_path / "served"
        served.mkdir()
        for f in target_dir.iterdir():
            (served / f.name).symlink_to(f)
        (served / "mtp.safetensors").symlink_to(tmp_path / "model" / "mtp.safetensors")
        options = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
    else:
        served = target_dir
        options = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(tmp_path / "model")}
        if algorithm == "dflash2":  # drafts from the map, the tokens still plain decoding's
            options["speculative_token_map"] = str(tmp_path / "model" / "token_map.pt")
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(str(served), device="cpu", dtype="float32", max_memory_gb=0.1)
    speculative = LLM(str(served), device="cpu", dtype="float32", max_memory_gb=0.1, **options)
    expected = [
        o.token_ids for o in plain.generate(sampling_params=params, prompt_token_ids=ids, use_tqdm=False)
    ]
    got = speculative.generate(sampling_params=params, prompt_token_ids=ids, use_tqdm=False)
    assert [o.token_ids for o in got] == expected


def test_a_killed_train_draft_resumes_to_the_same_loss_curve(target, tmp_path, monkeypatch):
    target_dir, prompts = target
    extra = ("--block-size", "4", "--num-layers", "1", "--checkpoint-every", "5")
    whole = _train(target_dir, prompts, tmp_path / "whole", "dflash", 12, *extra)

    one_step = loop.Trainer._one_step

    def killed_at_8(self):
        if self.step == 8:
            raise KeyboardInterrupt
        return one_step(self)

    monkeypatch.setattr(loop.Trainer, "_one_step", killed_at_8)
    with pytest.raises(KeyboardInterrupt):
        _train(target_dir, prompts, tmp_path / "killed", "dflash", 12, *extra)
    monkeypatch.setattr(loop.Trainer, "_one_step", one_step)
    assert _train(target_dir, prompts, tmp_path / "killed", "dflash", 12, *extra) == whole


def test_train_draft_rejects_a_target_without_a_mask_token_and_bad_data(tmp_path, model_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ["train-draft", "--target", str(model_dir), "--data", str(prompts), "--out", str(tmp_path / "o")]
    args += ["--num-prompts", "1", "--max-tokens", "2", "--steps", "1", "--device", "cpu", "--no-progress"]
    assert main(args) == 2
    assert "<|MASK|>" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": "no messages"}\n')
    args[4] = str(tmp_path / "bad.jsonl")
    assert main(args) == 2
    assert "bad.jsonl, line 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--target-layers", "1,one"])
    assert "--target-layers: must be comma-separated layer indices" in capsys.readouterr().err
    assert main([*args, "--token-map-size", "100000"]) == 2  # refused before any answer is generated
    assert "--token-map-size must be in [1, " in capsys.readouterr().err


def test_train_draft_trains_on_answers_cached_beforehand(target, tmp_path, monkeypatch):
    """Answers written with `write_distill_cache` (as the GPU script does from an earlier run's) are
    what training reads: no engine is started to generate them."""
    import hylo
    from hylo.tokenizer import Tokenizer
    from hylo.train.draft import training_prompts, write_distill_cache

    target_dir, prompts_file = target
    prompts = training_prompts(Tokenizer.from_dir(target_dir), prompts_file, 12, 256)
    answers = [[7 + i % 5] * (3 + i) for i in range(len(prompts))]
    write_distill_cache(tmp_path, prompts, 12, answers)

    def no_engine(*args, **kwargs):
        raise AssertionError("the cached answers should have been used")

    monkeypatch.setattr(hylo, "LLM", no_engine)
    _train(target_dir, prompts_file, tmp_path, "mtp", 2)
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["data"]["response_tokens"] == sum(map(len, answers))
