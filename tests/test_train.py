"""`hylo train`: the loop (schedule, checkpoints, exact resume) and the target trainer end to end on a
tiny config, whose export hylo loads and serves with the reference implementation's logits."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hf_reference import tiny_text_config

from hylo.cli import main
from hylo.models.loader import load_model
from hylo.train import data, target
from hylo.train.loop import LOSS_LOG, Trainer, TrainSettings, learning_rate, step_generator

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "the", "dog", "ran", "far", "away", "from", "home"]


def _conversations(count: int) -> list[data.Conversation]:
    """Deterministic chat: the user names a word, the assistant continues the fixed word cycle."""
    out = []
    for i in range(count):
        w = WORDS[i % len(WORDS)]
        reply = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(12))
        messages = ({"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": reply})
        out.append(data.Conversation(f"c{i}", messages))
    return out


def _regression(seed: int):
    """A linear model learning a fixed map, with batches drawn per step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 1)
    truth = torch.randn(8, 1)

    def batch_at(step):
        x = torch.randn(16, 8, generator=step_generator(seed, step))
        return x, x @ truth

    def loss_fn(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y), {}

    return model, batch_at, loss_fn


def test_schedule_warms_up_then_decays_to_the_floor():
    s = TrainSettings(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    rates = [learning_rate(s, i, 100) for i in range(101)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))
    assert rates[100] == pytest.approx(0.1)


def test_a_killed_run_resumes_to_the_same_loss_curve(tmp_path):
    settings = TrainSettings(steps=40, lr=0.3, warmup=5, checkpoint_every=10, seed=3, weight_decay=0.0)
    model, batch_at, loss_fn = _regression(3)
    whole = [
        h["loss"] for h in Trainer(model, batch_at, loss_fn, settings, tmp_path / "a", progress=False).run()
    ]
    assert whole[-1] < 0.2 * whole[0]

    model, batch_at, loss_fn = _regression(3)

    def dies_at_25(step):
        if step == 25:
            raise KeyboardInterrupt  # killed between checkpoints 20 and 30
        return batch_at(step)

    with pytest.raises(KeyboardInterrupt):
        Trainer(model, dies_at_25, loss_fn, settings, tmp_path / "b", progress=False).run()
    model, batch_at, loss_fn = _regression(3)  # a new process: fresh weights, restored from the checkpoint
    resumed = Trainer(model, batch_at, loss_fn, settings, tmp_path / "b", progress=False)
    assert resumed.resume() and resumed.step == 20
    resumed.run()
    logged = [json.loads(line)["loss"] for line in (tmp_path / "b" / LOSS_LOG).read_text().splitlines()]
    assert logged == whole  # same machine, same order of operations: the same bits


def test_resume_refuses_other_settings(tmp_path):
    model, batch_at, loss_fn = _regression(0)
    Trainer(
        model, batch_at, loss_fn, TrainSettings(steps=4, lr=0.1, checkpoint_every=2), tmp_path, progress=False
    ).run()
    other = Trainer(model, batch_at, loss_fn, TrainSettings(steps=8, lr=0.1, checkpoint_every=2), tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        other.resume()


def test_time_budget_fixes_the_schedule_length(tmp_path):
    model, batch_at, loss_fn = _regression(1)
    settings = TrainSettings(steps=10_000, lr=0.05, warmup=2, checkpoint_every=1000, time_budget_s=0.5)
    trainer = Trainer(model, batch_at, loss_fn, settings, tmp_path, progress=False)
    history = trainer.run()
    assert 15 <= trainer.total < 10_000 and len(history) == trainer.total


def test_bad_settings_name_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match="lr"):
        TrainSettings(steps=10, lr=0.0)
    with pytest.raises(ValueError, match="steps"):
        TrainSettings(steps=0, lr=0.1)
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path), "--steps", "0"])
    assert "--steps: must be > 0" in capsys.readouterr().err


def test_hylo_train_end_to_end_on_a_tiny_config(tmp_path, monkeypatch):
    """Tokenizer, encoded splits, training (loss falls), export: hylo loads the result, its logits are
    the reference implementation's, and the held-out split never entered training."""
    conversations = _conversations(400)
    monkeypatch.setattr(data, "load_conversations", lambda limit=None: conversations)
    monkeypatch.setattr(target, "TOKENIZER_SAMPLE", 400)
    config = tiny_text_config(4, 64, "shared", router_aux_loss_coef=0.01) | {"model_type": "glm5_next_text"}
    for key in ("vocab_size", "pad_token_id"):
        config.pop(key)
    monkeypatch.setattr(target, "VOCAB_SIZE", 300)  # about all the symbols 400 tiny conversations give
    # the reference implementation trains slowly on the CPU (~1 s a step here): few, large steps
    settings = TrainSettings(steps=16, lr=1e-2, warmup=2, checkpoint_every=8)
    report = target.train_target(
        tmp_path, settings, batch_size=4, seq_len=32, text_config=config, progress=False
    )
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / LOSS_LOG).read_text().splitlines()]
    assert len(losses) == 16 and sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    train, held_out = data.split(conversations)
    assert report["split"]["held_out_conversations"] == len(held_out) > 0
    assert report["split"]["train_conversations"] == len(train)
    assert report["held_out_loss"] < losses[0]

    from transformers import Glm5NextForConditionalGeneration

    exported = tmp_path / "model"
    hylo_model = load_model(exported, dtype=torch.float32, progress=False)
    reference = Glm5NextForConditionalGeneration.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor(data.encode_conversation(target.Tokenizer.from_dir(exported), held_out[0])[0])[None]
    from conftest import Caches

    caches = Caches(hylo_model, num_seqs=1, per_seq=64)
    ours = caches.forward(hylo_model, [caches.chunk(0, ids[0].tolist(), 0)])
    with torch.no_grad():
        theirs = reference(input_ids=ids).logits[0].float()
    torch.testing.assert_close(
        ours.float(), theirs, atol=1e-3, rtol=0
    )  # the same bf16 weights, fp32 arithmetic

    # `--init-from`: a new schedule from the exported weights (step 0 draws the same batch as the first
    # run's step 0, so its loss is the trained model's on that batch, not a fresh initialisation's)
    again = tmp_path / "again"
    target.train_target(
        again, TrainSettings(steps=1, lr=1e-6, warmup=0), batch_size=4, seq_len=32, text_config=config,
        tokenizer=tmp_path, progress=False, init_from=exported,
    )  # fmt: skip
    restarted = json.loads((again / "run" / LOSS_LOG).read_text().splitlines()[0])["loss"]
    assert restarted < 0.8 * losses[0], (restarted, losses)
    other = target.build_model(config | {"hidden_size": 32}, target.Tokenizer.from_dir(exported), seed=0)
    with pytest.raises(ValueError, match="not a checkpoint of this target's config"):
        target.load_weights(other, exported)


def test_hylo_train_without_the_reference_implementation_says_what_to_install(tmp_path, monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(target, "train_target", missing)
    assert main(["train", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "transformers==5.23.0" in capsys.readouterr().err
