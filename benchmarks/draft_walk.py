"""The greedy τ a DFlash/DFlash2 draft would reach when served, estimated without serving it.

Greedy verification commits the target's own greedy tokens whatever the draft proposes, so the
served run is known in advance: the target's greedy answer. One teacher-forced draft pass over the
answer, every position an anchor (`DFlashObjective.hidden`, the training pass), gives each anchor's
leading correct drafts; walking the answer the way verify steps do (the anchor after a step is the
token after the ones it accepted) gives the τ of every step the engine would run. A few seconds per
draft where serving takes minutes; `--check` serves the drafts too and prints both (session 21: within
1.5% on 40 held-out prompts, the difference being the last step of each answer).

    .venv/bin/python benchmarks/draft_walk.py --prompts 40 --max-tokens 48 DRAFT_DIR [DRAFT_DIR ...] [--check]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from demo_acceptance import held_out_prompts

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.demo import default_model_dir
from hylo.models.dflash import DFlashConfig, DFlashDraftModel
from hylo.models.loader import load_flat, load_model
from hylo.sampling import SamplingParams
from hylo.tokenizer import Tokenizer
from hylo.train.dflash import DFlashObjective, block_targets
from hylo.train.distill import build_distill_set


def served(model: Path, prompts: list[list[int]], max_tokens: int, draft: Path | None) -> tuple[list, list]:
    """(each prompt's greedy answer, the τ of every verify step) from the engine, CPU fp32."""
    options = {}
    if draft is not None:
        options = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                       speculative_adaptive=False)  # fmt: skip
    engine = Engine(EngineConfig.from_kwargs(model=str(model), device="cpu", dtype="float32", **options))
    answers: dict[str, list[int]] = {}
    taus = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            answers.setdefault(out.request.request_id, []).extend(out.new_token_ids)
            if out.accepted_drafts is not None:
                taus.append(out.accepted_drafts + 1)
    engine.close()
    return [answers[f"p{i}"] for i in range(len(prompts))], taus


@torch.no_grad()
def walk(objective: DFlashObjective, tokens, features, mask, prompt_len: int, answer_len: int) -> list[int]:
    """τ of each verify step over one answer: the first answer token comes from the prefill, each
    step anchors at the newest committed token and commits its accepted drafts and one more."""
    block = objective.draft.config.block_size
    anchors = torch.arange(prompt_len, prompt_len + answer_len - 1)[None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    targets, valid = block_targets(tokens, mask, anchors, keep, block)
    rows = objective.hidden(tokens, features, anchors)[:, :, 1:]
    proposals = objective.proposals(rows, objective.logits(rows), tokens.gather(1, anchors))
    accepted = ((proposals == targets) & valid).int().cumprod(-1).sum(-1)[0].tolist()
    taus, committed = [], 1
    while committed < answer_len:
        step = accepted[committed - 1] + 1
        taus.append(min(step, answer_len - committed))
        committed += step
    return taus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("drafts", type=Path, nargs="+", help="DFlash / DFlash2 draft directories")
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--check", action="store_true", help="serve each draft too")
    args = parser.parse_args()
    prompts = held_out_prompts(args.model, args.prompts, 256)
    answers, _ = served(args.model, prompts, args.max_tokens, None)
    target = load_model(args.model, device="cpu", dtype=torch.float32, progress=False)
    pad = Tokenizer.from_dir(args.model).pad_token_id
    for path in args.drafts:
        config = json.loads((path / "config.json").read_text())
        draft = DFlashDraftModel(DFlashConfig.from_dict(config))
        load_flat(draft, path)
        objective = DFlashObjective(draft.float(), target.embed_tokens, target.lm_head)
        examples = build_distill_set(
            target, prompts, answers, config["dflash_config"]["target_layer_ids"], pad
        )
        taus = []
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            tokens, features, mask = examples.batch(torch.tensor([i]))
            taus += walk(objective, tokens, features, mask, len(prompt), len(answer))
        report = {"draft": str(path), "walk_tau": round(sum(taus) / len(taus), 3), "steps": len(taus)}
        if args.check:
            same, served_taus = served(args.model, prompts, args.max_tokens, path)
            assert same == answers, "greedy speculative decoding changed the answers"
            report |= {
                "served_tau": round(sum(served_taus) / len(served_taus), 3),
                "served_steps": len(served_taus),
            }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
