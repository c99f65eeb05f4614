"""`hylo train` and `hylo train-draft` command lines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hylo.train import DRAFT_ALGORITHMS

if TYPE_CHECKING:
    from hylo.train.loop import TrainSettings

# FR-Spec's and SGLang's usual map for 128K-150K vocabularies
DEFAULT_TOKEN_MAP_SIZE = 32768
# The target (and the MTP layer's training forward) train through the reference implementation.
REFERENCE_NEEDED = (
    "transformers is not installed: training needs transformers==5.23.0 (pip install -e '.[dev]')"
)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _add_settings(parser: argparse.ArgumentParser, steps: int, lr: float, batch_size: int) -> None:
    parser.add_argument(
        "--out", type=Path, required=True, help="output directory (resumed when it has a run)"
    )
    parser.add_argument(
        "--steps", type=_positive(int), default=steps, help="optimizer steps (schedule length)"
    )
    parser.add_argument(
        "--time-budget", type=_positive(float), default=None,
        help="seconds to train: the schedule is fitted to it after the first steps (at most --steps)",
    )  # fmt: skip
    parser.add_argument("--lr", type=_positive(float), default=lr, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    parser.add_argument("--batch-size", type=_positive(int), default=batch_size, help="sequences a step")
    parser.add_argument(
        "--checkpoint-every", type=_positive(int), default=500, help="steps between checkpoints"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batches")
    parser.add_argument(
        "--device", type=_device, default="auto", help="torch device to train on (auto: cuda when available)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _layer_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer indices, got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"must be distinct layer indices >= 0, got {text!r}")
    return ids


def _device(text: str) -> str:
    """`--device`'s value, auto resolved at parsing (torch is imported only then: building the
    parsers imports none)."""
    if text != "auto":
        return text
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _settings(args: argparse.Namespace) -> TrainSettings:
    from hylo.train.loop import TrainSettings  # (torch: not for building the parsers)

    return TrainSettings(
        steps=args.steps, lr=args.lr, warmup=args.warmup, checkpoint_every=args.checkpoint_every,
        seed=args.seed, time_budget_s=args.time_budget,
    )  # fmt: skip


def _reported(command: str, run: Callable[[], dict]) -> dict | None:
    """`run()`'s report, or None after one line on stderr naming what is wrong with the input (a
    checkpoint, a setting, a file: `CheckpointError` is a `ValueError`) or what to install."""
    try:
        return run()
    except (ValueError, FileNotFoundError) as e:
        print(f"hylo {command}: {e}", file=sys.stderr)
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
        print(f"hylo {command}: {REFERENCE_NEEDED}", file=sys.stderr)
    return None


def add_train_args(parser: argparse.ArgumentParser) -> None:
    _add_settings(parser, steps=6000, lr=3e-3, batch_size=64)
    parser.add_argument("--seq-len", type=_positive(int), default=256, help="tokens a training window")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="use this directory's tokenizer instead of training one"
    )
    parser.add_argument(
        "--limit", type=_positive(int), default=None, help="read only the first N ShareGPT conversations"
    )
    parser.add_argument(
        "--init-from", type=Path, default=None,
        help="start from this target checkpoint (an earlier run's model/, same config) instead of a new one",
    )  # fmt: skip


def run_train(args: argparse.Namespace) -> int:
    from hylo.train.target import train_target

    report = _reported("train", lambda: train_target(
        args.out, _settings(args), batch_size=args.batch_size, seq_len=args.seq_len, device=args.device,
        limit=args.limit, tokenizer=args.tokenizer, progress=not args.no_progress, init_from=args.init_from,
    ))  # fmt: skip
    if report is None:
        return 2
    print(json.dumps({k: report[k] for k in ("held_out_loss", "held_out_perplexity", "parameters")}))
    return 0


def add_train_draft_args(parser: argparse.ArgumentParser) -> None:
    _add_settings(parser, steps=3000, lr=1e-3, batch_size=32)
    parser.add_argument("--target", type=Path, required=True, help="the target model directory")
    parser.add_argument("--algorithm", choices=DRAFT_ALGORITHMS, default="dflash", help="what to train")
    parser.add_argument(
        "--data", default="sharegpt",
        help="prompts: 'sharegpt' (the train split's user turns, first turns first) or a JSONL file of "
        "{\"messages\": [...]} conversations (their first user turns)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=_positive(int), default=4000, help="prompts to distil")
    parser.add_argument(
        "--max-prompt-tokens", type=_positive(int), default=256, help="longer prompts are skipped"
    )
    parser.add_argument(
        "--max-tokens", type=_positive(int), default=192, help="tokens of each target response"
    )
    parser.add_argument(
        "--num-layers", type=_positive(int), default=None, help="draft layers (DFlash/DFlash2)"
    )
    parser.add_argument("--block-size", type=_positive(int), default=8, help="DFlash block size")
    parser.add_argument(
        "--intermediate-size", type=_positive(int), default=None, help="draft MLP width (default 3 x hidden)"
    )
    parser.add_argument(
        "--target-layers", type=_layer_ids, default=None,
        help="target layers the DFlash draft reads, comma-separated (default: z-lab's spread, one a layer)",
    )  # fmt: skip
    parser.add_argument(
        "--init-from", type=Path, default=None, help="start from this DFlash draft's weights (same config)"
    )
    parser.add_argument(
        "--token-map-size", type=_positive(int), default=None,
        help="also write OUT/model/token_map.pt, the N most frequent tokens of the target's answers "
        "(for --speculative-token-map)",
    )  # fmt: skip


def run_train_draft(args: argparse.Namespace) -> int:
    from hylo.train.draft import train_draft

    options = {}
    if args.algorithm != "mtp":
        options["block_size"] = args.block_size
        if args.num_layers is not None:
            options["num_layers"] = args.num_layers
        if args.intermediate_size is not None:
            options["intermediate_size"] = args.intermediate_size
        if args.target_layers is not None:
            options["target_layer_ids"] = args.target_layers
        if args.init_from is not None:
            options["init_from"] = args.init_from
    elif any(
        v is not None for v in (args.num_layers, args.intermediate_size, args.target_layers, args.init_from)
    ):
        print(
            "hylo train-draft: --num-layers, --intermediate-size, --target-layers and --init-from apply to "
            "DFlash drafts only (the MTP layer has the target's sizes)",
            file=sys.stderr,
        )
        return 2
    report = _reported("train-draft", lambda: train_draft(
        args.target, args.out, args.algorithm, _settings(args), source=args.data,
        num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        batch_size=args.batch_size, device=args.device, draft_options=options, progress=not args.no_progress,
        token_map_size=args.token_map_size,
    ))  # fmt: skip
    if report is None:
        return 2
    print(json.dumps({"algorithm": report["algorithm"], "last_losses": report["last_losses"]}))
    return 0


def add_token_map_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, required=True, help="the target model directory (its tokenizer)"
    )
    parser.add_argument(
        "--data", default="sharegpt",
        help="text to count: 'sharegpt' (the assistant replies of the train split) or a JSONL file of "
        "{\"messages\": [...]} conversations (every token of each, rendered with the chat template)",
    )  # fmt: skip
    parser.add_argument(
        "--size", type=_positive(int), default=None,
        help=f"tokens in the map (default: {DEFAULT_TOKEN_MAP_SIZE}, or a quarter of a smaller vocabulary)",
    )  # fmt: skip
    parser.add_argument(
        "--limit", type=_positive(int), default=None, help="read only the first N conversations"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the map file: .pt (torch.save, SGLang's format) or .json"
    )


def run_token_map(args: argparse.Namespace) -> int:
    """The `--size` most frequent tokens of `--data` (the tokenizer's stop tokens always among them), for
    `--speculative-token-map`."""
    from hylo.speculative.token_map import coverage, hot_tokens, save_token_map
    from hylo.tokenizer import Tokenizer
    from hylo.train import data
    from hylo.train.draft import jsonl_conversations

    def build() -> dict:
        tokenizer = Tokenizer.from_dir(args.model)
        size = args.size or min(DEFAULT_TOKEN_MAP_SIZE, tokenizer.vocab_size // 4)
        if size > tokenizer.vocab_size:
            raise ValueError(f"--size {size} exceeds the vocabulary ({tokenizer.vocab_size} tokens)")
        if args.data == "sharegpt":
            train, _ = data.split(data.load_conversations(args.limit))
            encoded = (data.encode_conversation(tokenizer, c) for c in train)
            sequences = [[t for t, produced in zip(*e, strict=True) if produced] for e in encoded]
        else:
            conversations = jsonl_conversations(Path(args.data))[: args.limit]
            sequences = [
                tokenizer.encode(tokenizer.apply_chat_template(list(c.messages)), add_special_tokens=False)
                for c in conversations
            ]
        ids = hot_tokens(sequences, size, always=tokenizer.eos_token_ids)
        save_token_map(ids, args.out)
        counted = sum(map(len, sequences))
        return {"tokens": len(ids), "counted": counted, "coverage": round(coverage(ids, sequences), 4)}

    report = _reported("token-map", build)
    if report is None:
        return 2
    print(json.dumps(report | {"out": str(args.out)}))
    return 0
