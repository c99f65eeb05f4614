"""lm-eval's `local-completions` against a hylo server, scored the way its loglikelihood tasks score
(completions with `echo`, `logprobs` and the prompt's token logprobs), beside the offline `LLM` API's own
loglikelihoods of the same tokens: the two must pick the same choice for every question and give the
same accuracy (issue 21).

    .venv/bin/python benchmarks/lm_eval_parity.py --lm-eval VENV/bin/lm_eval [--model DIR] [--out DIR]

lm-eval lives in a virtual environment of its own (`pip install "lm-eval[api]==0.4.13" transformers`:
its dependencies are not hylo's); this script starts `hylo serve` on a loopback port, writes a local
multiple-choice task (`QUESTIONS`, a JSON file and a task YAML), runs lm-eval on it with its
per-sample log, and compares.
Without `--model` it uses a fresh demo model.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hylo import LLM, SamplingParams
from hylo.models.demo import write_random_model
from hylo.tokenizer import Tokenizer

# (context, choices, index of the right one); lm-eval puts its target delimiter (a space) between them
QUESTIONS = [
    ("The opposite of hot is", ["cold", "warm", "loud", "green"], 0),
    ("Two plus two equals", ["three", "four", "five", "seven"], 1),
    ("The sky on a clear day is", ["red", "blue", "square", "late"], 1),
    ("A baby cat is called a", ["puppy", "calf", "kitten", "foal"], 2),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "north"], 0),
    ("The capital of France is", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Bees make", ["milk", "honey", "glass", "rain"], 1),
    ("The first month of the year is", ["March", "June", "January", "May"], 2),
    ("You read a book with your", ["eyes", "ears", "feet", "elbows"], 0),
    ("Ice is frozen", ["fire", "water", "sand", "wood"], 1),
    ("A week has", ["five days", "seven days", "ten days", "two days"], 1),
    ("The sun rises in the", ["west", "east", "south", "cellar"], 1),
    ("Fish live in", ["trees", "water", "deserts", "clouds"], 1),
    ("Snow is usually", ["black", "white", "purple", "hot"], 1),
    ("A triangle has", ["three sides", "four sides", "six sides", "no sides"], 0),
    ("People sleep at", ["night", "noon", "lunch", "school"], 0),
]
TASK = "hylo_local_mc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_task(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    data = root / "questions.jsonl"
    rows = [{"question": q, "choices": c, "label": a} for q, c, a in QUESTIONS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    return root


def serve(model: Path, port: int) -> subprocess.Popen:
    hylo = Path(sys.executable).with_name("hylo")
    proc = subprocess.Popen(
        [str(hylo), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"hylo serve exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("hylo serve did not become healthy in 300 s")


def lm_eval_samples(lm_eval: str, model: Path, port: int, tasks: Path, out: Path) -> list[dict]:
    name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    args = (
        f"base_url=http://127.0.0.1:{port}/v1/completions,model={name},tokenizer_backend=huggingface,"
        f"tokenizer={model},tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    subprocess.run(
        [lm_eval, "--model", "local-completions", "--model_args", args, "--tasks", TASK, "--include_path",
         str(tasks), "--log_samples", "--output_path", str(out), "--batch_size", "1"],
        check=True,
    )  # fmt: skip
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def offline_loglikelihoods(model: Path, samples: list[dict]) -> dict[int, list[float]]:
    """Each choice's loglikelihood given its context, from `prompt_logprobs` of the offline API, over
    the tokens lm-eval sends: its (context, continuation) strings, trailing spaces of the context
    moved to the continuation, the whole encoded and the context's tokens split off."""
    tokenizer = Tokenizer.from_dir(model)
    llm = LLM(str(model), device="cpu")
    scores = {}
    for sample in samples:
        wholes, starts = [], []
        for pair in sample["arguments"].values():
            context, continuation = pair["arg_0"], pair["arg_1"]
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            wholes.append(tokenizer.encode(context + continuation, add_special_tokens=False))
            starts.append(len(tokenizer.encode(context, add_special_tokens=False)))
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        outs = llm.generate(prompt_token_ids=wholes, sampling_params=params, use_tqdm=False)
        scores[sample["doc_id"]] = [
            sum(out.prompt_logprobs[p][whole[p]] for p in range(start, len(whole)))
            for whole, start, out in zip(wholes, starts, outs, strict=True)
        ]
    return scores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command (its own environment)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    model = args.model
    if model is None:
        model = root / "demo"
        write_random_model(model)
    port = free_port()
    proc = serve(model, port)
    try:
        samples = lm_eval_samples(args.lm_eval, model, port, write_task(root / "tasks"), root / "lm_eval")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    served = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    offline = offline_loglikelihoods(model, samples)
    picks_served = [max(range(len(v)), key=v.__getitem__) for _, v in sorted(served.items())]
    picks_offline = [max(range(len(v)), key=v.__getitem__) for _, v in sorted(offline.items())]
    answers = [a for *_, a in QUESTIONS]
    largest = max(abs(a - b) for d, v in served.items() for a, b in zip(v, offline[d], strict=True))
    report = {
        "questions": len(QUESTIONS),
        "lm_eval_acc": sum(p == a for p, a in zip(picks_served, answers, strict=True)) / len(answers),
        "offline_acc": sum(p == a for p, a in zip(picks_offline, answers, strict=True)) / len(answers),
        "same_picks": picks_served == picks_offline,
        "largest_loglikelihood_difference": largest,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lm_eval_parity.json").write_text(json.dumps(report, indent=1))
    sys.exit(0 if report["same_picks"] and math.isclose(report["lm_eval_acc"], report["offline_acc"]) else 1)


if __name__ == "__main__":
    main()
