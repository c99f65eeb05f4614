"""Logprobs in OpenAI's two formats. A token is named by its text, or, when its bytes are not
whole UTF-8 characters, by `bytes:\\xNN...` (OpenAI's convention) so that distinct byte tokens stay
distinct; a top-logprob dict (the completions format) keys a text seen twice by `token_id:N`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def token_bytes(tokenizer, token_id: int) -> bytes:
    return tokenizer.token_bytes(token_id) if tokenizer is not None else str(token_id).encode()


def token_text(tokenizer, token_id: int) -> str:
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(
    tokenizer, ids: Sequence[int], entries: Sequence[dict[int, float] | None]
) -> dict[str, Any]:
    """The legacy completions format: tokens, their logprobs, and the top-n per position (null for
    a position without any: an echoed prompt's first token)."""

    def top(entry: dict[int, float]) -> dict[str, float]:
        named: dict[str, float] = {}
        for t, lp in entry.items():
            text = token_text(tokenizer, t)
            named[f"token_id:{t}" if text in named else text] = lp
        return named

    return {
        "tokens": [token_text(tokenizer, t) for t in ids],
        "token_logprobs": [None if e is None else e[t] for t, e in zip(ids, entries, strict=True)],
        "top_logprobs": [None if e is None else top(e) for e in entries],
        "text_offset": None,
    }


def chat_logprobs(tokenizer, ids: Sequence[int], entries: Sequence[dict[int, float]], top_n: int) -> dict:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_text(tokenizer, token_id),
            "logprob": logprob,
            "bytes": list(token_bytes(tokenizer, token_id)),
        }

    return {
        "content": [
            item(t, entry[t])
            | {
                "top_logprobs": [
                    item(i, lp) for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
                ]
            }
            for t, entry in zip(ids, entries, strict=True)
        ]
    }
