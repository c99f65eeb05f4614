"""Write the draft-training prompts of the demo as JSONL (`{"messages": [...]}` a line): the user turns
of ShareGPT's train split, first turns first (`hylo.train.data.prompt_turns`), each of at most
`--max-prompt-tokens` tokens with the demo's chat template. `hylo train-draft --data sharegpt` reads the
same prompts from the package; the file carries them to a GPU machine that has no room for it.

    python benchmarks/demo_draft_prompts.py --out prompts.jsonl --count 20000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hylo.models.demo import DEMO_DIR
from hylo.tokenizer import Tokenizer
from hylo.train import data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, default=DEMO_DIR)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    train, _ = data.split(data.load_conversations())
    kept = []
    for i, turn in enumerate(data.prompt_turns(train)):
        if len(data.prompt_ids(tokenizer, data.Conversation(str(i), turn))) <= args.max_prompt_tokens:
            kept.append(turn)
        if len(kept) == args.count:
            break
    with args.out.open("w") as out:
        out.writelines(json.dumps({"messages": list(turn)}) + "\n" for turn in kept)
    print(f"{len(kept)} prompts to {args.out}")


if __name__ == "__main__":
    main()
