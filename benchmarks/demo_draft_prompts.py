"""Write the draft-training prompts of the demo as JSONL (`{"messages": [...]}` a line): what
`hylo train-draft --data sharegpt` reads from the package (`hylo.train.draft.training_conversations`:
the user turns of ShareGPT's train split, first turns first, each of at most `--max-prompt-tokens`
tokens with the demo's chat template); the file carries them to a GPU machine that has no room for it.

    python benchmarks/demo_draft_prompts.py --out prompts.jsonl --count 20000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hylo.models.demo import DEMO_DIR
from hylo.tokenizer import Tokenizer
from hylo.train.draft import training_conversations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, default=DEMO_DIR)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    kept = training_conversations(tokenizer, "sharegpt", args.count, args.max_prompt_tokens)
    with args.out.open("w") as out:
        out.writelines(json.dumps({"messages": list(c.messages)}) + "\n" for c, _ in kept)
    print(f"{len(kept)} prompts to {args.out}")


if __name__ == "__main__":
    main()
