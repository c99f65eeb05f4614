"""`hylo` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory (config.json, *.safetensors, tokenizer.json). "
        "Default: hylo's embedded tiny random-weight GLM-5.3-Flash, written on first use.",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="weights and activations dtype; auto = bfloat16 on GPU, float32 on CPU",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hylo", description="Serve hybrid linear/sparse-attention MoE models."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens"
    )
    return parser


def _resolve_model(arg: str | None) -> Path:
    if arg is not None:
        path = Path(arg)
        if not path.is_dir():
            raise SystemExit(f"hylo: --model {arg}: not a directory")
        return path
    from hylo.models.demo import ensure_default_model

    path = ensure_default_model()
    print(
        f"hylo: no --model given; using the embedded demo model at {path} "
        "(a tiny GLM-5.3-Flash with random weights: its output is gibberish by design)",
        file=sys.stderr,
    )
    return path


def _resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"hylo: --device {device}: CUDA is not available on this machine")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


def _generate(args: argparse.Namespace) -> int:
    from hylo.generation import Sampling, generate
    from hylo.models.loader import CheckpointError, load_model
    from hylo.tokenizer import IncrementalDetokenizer, Tokenizer

    path = _resolve_model(args.model)
    device, dtype = _resolve_device(args.device, args.dtype)
    try:
        tokenizer = Tokenizer.from_dir(path)
        model = load_model(path, device=device, dtype=dtype)
        text = args.prompt
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt = tokenizer.encode(text, add_special_tokens=not args.chat)
        stops = () if args.ignore_eos else tuple(tokenizer.eos_token_ids)
        params = Sampling(args.max_tokens, args.temperature, args.top_p, args.seed, stops)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"hylo: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(tokenizer, prompt)

    def emit(_: int, ids: list[int]) -> None:
        sys.stdout.write(detok.step(ids))
        sys.stdout.flush()

    generate(model, [prompt], params, on_tokens=emit)
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
