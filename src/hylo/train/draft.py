"""`hylo train-draft`: a DFlash / DFlash2 draft or the MTP layer, trained for a frozen target.

The recipe (`../shared/research/dflash.md` §3): the target regenerates the responses to the training
prompts itself (self-distillation, served by hylo), hylo's own forward captures the target features
the proposer will read at serving time, and only the draft trains (DFlash: random anchors in the
responses, bidirectional blocks, position-decayed cross-entropy; MTP: next-next-token prediction
from the target's last hidden). Everything before training is cached in `out/distill.pt`, and the
run itself resumes from `out/run/` (see `hylo.train.loop`).

Output: `out/model/` — for DFlash/DFlash2 a z-lab-format draft directory (`--speculative-draft-model-path`),
for MTP `mtp.safetensors` to put beside the target's weights (`--speculative-algorithm MTP`) — and
`out/training.json` (settings, data, the last losses).
"""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from hylo.models.loader import load_flat, load_model
from hylo.speculative.token_map import coverage, hot_tokens, save_token_map
from hylo.tokenizer import Tokenizer
from hylo.train import DRAFT_ALGORITHMS, data
from hylo.train.distill import DistillSet, build_distill_set, regenerate
from hylo.train.loop import Trainer, TrainSettings, step_generator

DISTILL_CACHE = "distill.pt"
TOKEN_MAP = "token_map.pt"
GENERATION_MEMORY_FRACTION = 0.3
MTP_TRAIN_STEPS = 3  # chained MTP steps the loss trains, as many as the demo serves


class DraftTargetMismatch(ValueError):
    """The draft asked for cannot be made for this target (no mask token, a different `--init-from`
    draft): says which and why."""


def training_prompts(
    tokenizer: Tokenizer, source: str | Path, count: int, max_prompt_tokens: int
) -> list[list[int]]:
    """The prompt ids of `training_conversations`."""
    return [ids for _, ids in training_conversations(tokenizer, source, count, max_prompt_tokens)]


def training_conversations(
    tokenizer: Tokenizer, source: str | Path, count: int, max_prompt_tokens: int
) -> list[tuple[data.Conversation, list[int]]]:
    """Up to `count` (prompt conversation, its prompt ids) of at most `max_prompt_tokens` tokens: the
    user turns of ShareGPT's train split, first turns first (`source == "sharegpt"`, see
    `data.prompt_turns`), or the first user turns of a JSONL file of `{"messages": [...]}`
    conversations."""
    if str(source) == "sharegpt":
        train, _ = data.split(data.load_conversations())
        turns = data.prompt_turns(train)
        conversations = [data.Conversation(f"sharegpt-turn-{i}", turn) for i, turn in enumerate(turns)]
    else:
        conversations = jsonl_conversations(Path(source))
    kept = []
    for conversation in conversations:
        ids = data.prompt_ids(tokenizer, conversation)
        if len(ids) <= max_prompt_tokens:
            kept.append((conversation, ids))
        if len(kept) == count:
            break
    if not kept:
        raise ValueError(f"{source}: no prompt of at most {max_prompt_tokens} tokens")
    return kept


def jsonl_conversations(path: Path) -> list[data.Conversation]:
    """The `{"messages": [...]}` conversations of a JSONL file, each starting with a system or user
    message; a `ValueError` names the line that is not one."""
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (give 'sharegpt' or a JSONL file)")
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if not messages or messages[0].get("role") not in ("system", "user"):
                raise ValueError("the conversation must start with a system or user message")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(
                f"--data {path}, line {number}: not a {{'messages': [...]}} conversation ({e})"
            ) from e
        conversations.append(data.Conversation(f"{path.name}:{number}", tuple(messages)))
    return conversations


def distill(
    target_dir: Path, out: Path, prompts: Sequence[Sequence[int]], max_tokens: int, device: str, dtype
) -> list[list[int]]:
    """The target's greedy responses to `prompts`, generated once and cached in `out/distill.pt`."""
    cache = out / DISTILL_CACHE
    if cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved["prompts"] == [list(p) for p in prompts] and saved["max_tokens"] == max_tokens:
            return saved["responses"]
    from hylo import LLM

    # A small share of the GPU: the memory training needs next is only given back when the engine goes.
    llm = LLM(
        str(target_dir), device=device, dtype=str(dtype).removeprefix("torch."), disable_radix_cache=True,
        mem_fraction_static=GENERATION_MEMORY_FRACTION,
    )  # fmt: skip
    responses = regenerate(llm, prompts, max_tokens)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write_distill_cache(out, prompts, max_tokens, responses)
    return responses


def write_distill_cache(
    out: Path, prompts: Sequence[Sequence[int]], max_tokens: int, responses: Sequence[Sequence[int]]
) -> None:
    """Cache `responses` (the target's answers to `prompts`, at most `max_tokens` each) as `distill`
    does, so that a run in `out` with the same prompts trains on them instead of generating again."""
    out.mkdir(parents=True, exist_ok=True)
    saved = {"prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
             "responses": [list(r) for r in responses]}  # fmt: skip
    torch.save(saved, out / DISTILL_CACHE)


def train_draft(
    target_dir: Path,
    out: Path,
    algorithm: str,
    settings: TrainSettings,
    source: str | Path = "sharegpt",
    num_prompts: int = 4000,
    max_prompt_tokens: int = 256,
    max_tokens: int = 192,
    batch_size: int = 32,
    device: str = "cpu",
    draft_options: dict | None = None,
    progress: bool = True,
    token_map_size: int | None = None,
) -> dict:
    """Train (or resume) a draft of `algorithm` for the target at `target_dir` into `out`; with
    `token_map_size`, also `out/model/token_map.pt`: the most frequent tokens of the target's answers
    (`--speculative-token-map`), as EAGLE-3 drafts get their reduced vocabulary from their data."""
    if algorithm not in DRAFT_ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {', '.join(DRAFT_ALGORITHMS)}, got {algorithm!r}")
    target_dir, out = Path(target_dir), Path(out)
    tokenizer = Tokenizer.from_dir(target_dir)
    if token_map_size is not None and not 0 < token_map_size <= tokenizer.vocab_size:
        raise ValueError(
            f"--token-map-size must be in [1, {tokenizer.vocab_size}] (the vocabulary), got {token_map_size}"
        )
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    prompts = training_prompts(tokenizer, source, num_prompts, max_prompt_tokens)
    responses = distill(target_dir, out, prompts, max_tokens, device, dtype)
    target = load_model(target_dir, device=device, dtype=dtype, progress=False)
    for p in target.parameters():
        p.requires_grad_(False)
    draft, loss_fn, layers, export = _objective(
        algorithm, target_dir, target, tokenizer, settings.seed, draft_options or {}
    )
    draft.to(device)
    examples = build_distill_set(target, prompts, responses, layers, tokenizer.pad_token_id)
    trainer = Trainer(
        draft, _batches(examples, batch_size, settings.seed), loss_fn, settings, out / "run",
        autocast=device != "cpu", progress=progress, description=f"hylo train-draft {algorithm}",
    )  # fmt: skip
    trainer.resume()
    history = trainer.run()
    export(out / "model")
    token_map = None
    if token_map_size is not None:
        ids = hot_tokens(responses, token_map_size, always=tokenizer.eos_token_ids)
        save_token_map(ids, out / "model" / TOKEN_MAP)
        share = round(coverage(ids, responses), 4)
        token_map = {"file": f"model/{TOKEN_MAP}", "tokens": len(ids), "answer_coverage": share}
    report = {
        "algorithm": algorithm,
        "target": str(target_dir),
        "data": {"source": str(source), "prompts": len(prompts), "max_tokens": max_tokens,
                 "response_tokens": int(examples.loss_mask.sum())},
        "settings": asdict(settings) | {"batch_size": batch_size, "steps_run": len(history)},
        "last_losses": [h["loss"] for h in history[-5:]],
        "token_map": token_map,
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _batches(examples: DistillSet, batch_size: int, seed: int):
    def batch_at(step: int):
        rows = torch.randint(
            len(examples), (min(batch_size, len(examples)),), generator=step_generator(seed, step)
        )
        return (*examples.batch(rows.to(examples.tokens.device)), step)

    return batch_at


def _objective(algorithm: str, target_dir: Path, target, tokenizer: Tokenizer, seed: int, options: dict):
    """(the module that trains, loss_fn(batch), the target layers its features come from, export(dir));
    a batch is (tokens, features, loss_mask, step)."""
    if algorithm == "mtp":
        from hylo.train.mtp import MTPObjective, export_mtp_layer, init_mtp_layer

        layer = init_mtp_layer(target, seed)
        objective = MTPObjective(layer, target)

        def mtp_loss(batch):
            tokens, features, mask, _ = batch
            return objective.loss(tokens, features, mask, steps=MTP_TRAIN_STEPS)

        def export(directory: Path) -> None:
            # the target's config beside the layer says what it was made for; the weights stay where they are
            directory.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(target_dir) / "config.json", directory / "config.json")
            export_mtp_layer(layer, directory, dtype=torch.bfloat16)

        return layer, mtp_loss, (target.config.num_hidden_layers - 1,), export
    from hylo.train.bpe import MASK_TOKEN
    from hylo.train.dflash import DFlashObjective, init_draft, new_draft_config, save_draft

    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    if mask_id is None:
        raise DraftTargetMismatch(
            f"the target's tokenizer has no {MASK_TOKEN} token: a DFlash draft needs a mask token id "
            "inside the target's vocabulary"
        )
    options = dict(options)
    init_from = options.pop("init_from", None)
    config = new_draft_config(target.config, algorithm, mask_token_id=mask_id, **options)
    draft = init_draft(config, seed)
    if init_from is not None:  # continue from a draft of exactly this shape
        saved = json.loads((Path(init_from) / "config.json").read_text())
        saved.pop("torch_dtype", None)  # what save_draft stored the weights in, not the draft's shape
        if saved != config:
            raise DraftTargetMismatch(
                f"--init-from {init_from}: its config.json differs from the draft asked for"
            )
        load_flat(draft, init_from)
    objective = DFlashObjective(draft, target.embed_tokens, target.lm_head)
    device = target.embed_tokens.weight.device

    def dflash_loss(batch):
        tokens, features, mask, step = batch
        return objective.loss(tokens, features, mask, step_generator(seed + 1, step, device))

    layers = config["dflash_config"]["target_layer_ids"]
    return draft, dflash_loss, layers, lambda d: save_draft(draft, config, d, dtype=torch.bfloat16)
