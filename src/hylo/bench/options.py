"""The options of `hylo bench serving` (`add_cli_args`), apart from the benchmark so that building the
CLI's parser does not import the client (httpx, the tokenizer, the progress bar)."""

from __future__ import annotations

import argparse
import math


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first from /v1/models)")
    parser.add_argument(
        "--dataset-name",
        "--dataset",
        dest="dataset",
        choices=["sharegpt", "random"],
        default="sharegpt",
        help="prompts: ShareGPT's first human turns, or random tokens (--random-*); vLLM's and "
        "SGLang's name, --dataset kept",
    )
    parser.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)"
    )
    parser.add_argument(
        "--random-input-len",
        type=int,
        default=256,
        help="random dataset: prompt tokens, counted by the served model's tokenizer as the server "
        "counts them (special tokens it adds included)",
    )
    parser.add_argument(
        "--random-output-len", type=int, default=128, help="random dataset: tokens to generate"
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="random dataset: lengths drawn from [ratio·len, len]",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="random dataset: directory of the served model's tokenizer.json (default: --model when it "
        "is a directory, else the model a hylo server on this machine reports in /server_info)",
    )
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="fixed output length for ShareGPT (default: the reply's, at 4 characters a token)",
    )
    parser.add_argument(
        "--disable-ignore-eos", action="store_true", help="let requests stop at end-of-sequence"
    )
    parser.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (a server's --api-key)"
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the dataset's draws and of the Poisson arrivals"
    )
    parser.add_argument("--output-json", default=None, help="write every metric to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
