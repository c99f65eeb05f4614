"""`hylo` command line."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import TYPE_CHECKING

from hylo.bench.options import add_cli_args as add_bench_args
from hylo.config import EngineConfig
from hylo.server.parsers import PARSERS
from hylo.server.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES

if TYPE_CHECKING:
    from hylo.sampling import SamplingParams


class _HelpFormatter(argparse.HelpFormatter):
    """Says an option's default once: appended as "(default: X)" unless its help already says what
    the default is (e.g. "(default: the model directory)", which argparse's
    ArgumentDefaultsHelpFormatter followed with "(default: None)") or the default says nothing (unset,
    a switch that is off, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or re.search(r"\bdefault\b", text, re.IGNORECASE)
            or default is argparse.SUPPRESS
            or default is None
            or default is False
            or default == []
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hylo", description="Serve hybrid linear/sparse-attention MoE models."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        formatter_class=_HelpFormatter,
        conflict_handler="resolve",  # generate's --seed replaces the engine's (see below)
    )
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens"
    )
    EngineConfig.add_cli_args(gen.add_argument_group("engine"))
    # One prompt is one request, so the engine's --seed (for requests without a seed of their own)
    # and a per-request seed would be two flags for one thing: generate's --seed is the prompt's.
    gen.add_argument(
        "--seed",
        "--sampling-seed",
        dest="sampling_seed",
        type=int,
        metavar="N",
        default=None,
        help="seed of the prompt's sampling: the same seed gives the same text, as the API's per-request "
        "seed does (--sampling-seed is its old name); unset, the engine's sampler draws with seed 0",
    )
    gen.set_defaults(seed=EngineConfig.seed)

    srv = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        formatter_class=_HelpFormatter,
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument(
        "--served-model-name", default=None, help="model name of the API (default: the directory name)"
    )
    srv.add_argument(
        "--get-load-format",
        choices=("vllm", "sglang"),
        default="vllm",
        help="shape of GET /get_load: vllm-router's {load} or sglang-router's list of per-rank loads",
    )
    srv.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish the prefix cache's pages as vLLM KV events on a ZMQ PUB socket bound here (port 0: "
        "a free one, shown by GET /kv_event_sources), for vllm-router's kv_aware policy; needs the "
        "kv-events extra",
    )
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests beyond which new ones get HTTP 429 (default: no limit)",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="parse tool calls of this chat format into tool_calls (chat requests with tools)",
    )
    srv.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        default=None,
        help="separate the reasoning of this chat format into reasoning_content",
    )
    srv.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for open requests before aborting them",
    )
    srv.add_argument(
        "--shutdown-abort-grace",
        type=float,
        default=3.0,
        help="seconds the aborted requests then get to send their last chunks, and the engine thread "
        "as long again to stop, before the server exits without them (a stuck engine: status 1)",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body accepted; larger ones get HTTP 413",
    )
    srv.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open after a response",
    )
    srv.add_argument(
        "--timeout-request-header",
        type=float,
        default=10.0,
        help="seconds a request's headers may take to arrive; then the connection closes (HTTP 408)",
    )
    srv.add_argument(
        "--timeout-request-body",
        type=float,
        default=30.0,
        help="seconds a request's body may take to arrive after its headers; slower ones get HTTP 408",
    )
    srv.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="open connections at most; a request on one more gets HTTP 503",
    )
    srv.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="/v1/responses stored (store: true) at most; a new one evicts the oldest",
    )
    srv.add_argument(
        "--responses-store-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help="seconds a stored /v1/responses response is kept (GET, previous_response_id)",
    )
    EngineConfig.add_cli_args(srv.add_argument_group("engine"))

    from hylo.train.cli import add_token_map_args, add_train_args, add_train_draft_args

    add_train_args(
        commands.add_parser(
            "train",
            help="train the embedded demo target on ShareGPT (resumable)",
            formatter_class=_HelpFormatter,
        )
    )
    add_train_draft_args(
        commands.add_parser(
            "train-draft",
            help="train a DFlash/DFlash2 draft or the MTP layer for a target (resumable)",
            formatter_class=_HelpFormatter,
        )
    )
    add_token_map_args(
        commands.add_parser(
            "token-map",
            help="the most frequent tokens of a dataset, for --speculative-token-map",
            formatter_class=_HelpFormatter,
        )
    )

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    add_bench_args(
        bench_kinds.add_parser(
            "serve",
            help="load-test an OpenAI-compatible server",
            formatter_class=_HelpFormatter,
        )
    )
    return parser


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The prompt's sampling, from generate's flags."""
    from hylo.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _generate(args: argparse.Namespace) -> int:
    from hylo.distributed.launch import start
    from hylo.engine.engine import Engine
    from hylo.models.loader import CheckpointError

    try:
        params = _sampling_params(args)
        config = EngineConfig.from_cli(args)
        engine = Engine(config, ranks=start(config))
        if not engine.ranks.leader:  # another host's (or torchrun's) rank: it follows rank 0
            from hylo.distributed.follower import follow

            follow(engine)
            return 0
        if engine.tokenizer is None:
            raise ValueError(f"{args.model}: no tokenizer.json, so text prompts cannot be encoded")
        text = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        engine.add_request("cli", engine.tokenizer.encode(text, add_special_tokens=not args.chat), params)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"hylo: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    engine.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hylo.models.loader import CheckpointError
    from hylo.server.launch import serve

    try:
        config = EngineConfig.from_cli(args)
        return serve(
            config,
            args.host,
            args.port,
            args.api_key,
            args.served_model_name,
            args.max_queued_requests,
            args.graceful_shutdown_timeout,
            args.max_request_bytes,
            args.tool_call_parser,
            args.reasoning_parser,
            args.timeout_keep_alive,
            args.timeout_request_header,
            args.timeout_request_body,
            args.limit_concurrency,
            args.get_load_format,
            args.responses_store_size,
            args.responses_store_age,
            args.kv_events_endpoint,
            args.shutdown_abort_grace,
        )
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"hylo: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="hylo: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command in ("train", "train-draft", "token-map"):
        from hylo.train.cli import run_token_map, run_train, run_train_draft

        run = {"train": run_train, "train-draft": run_train_draft, "token-map": run_token_map}
        return run[args.command](args)
    from hylo.bench.serving import run_from_cli

    return run_from_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
