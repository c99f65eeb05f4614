"""Logprobs in OpenAI's two formats. A token is named by its text, or, when its bytes are not
whole UTF-8 characters, by `bytes:\\xNN...` (OpenAI's convention) so that distinct byte tokens stay
distinct; a top-logprob dict (the completions format) keys a text seen twice by `token_id:N`."""

from __future__ import annotations

import codecs
from collections.abc import Collection, Sequence
from typing import Any


def token_bytes(tokenizer, token_id: int) -> bytes:
    return tokenizer.token_bytes(token_id) if tokenizer is not None else str(token_id).encode()


def token_text(tokenizer, token_id: int) -> str:
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token of one choice starts in the choice's text (the completions format's
    `text_offset`), fed the choice's tokens in order: the number of characters the tokens before it
    decode to. A token that ends inside a UTF-8 character adds nothing until a later one completes
    it (or, never completed, a U+FFFD before the next token, as in the text); a special token adds
    its text only where the text holds it (an echoed prompt's text, which lacks what the tokenizer
    added, such as a BOS) or where it is not skipped (generated tokens)."""

    def __init__(self, tokenizer, special_ids: Collection[int], skip_special_tokens: bool):
        self.tokenizer, self.special_ids, self.skip = tokenizer, special_ids, skip_special_tokens
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int], text: str | None = None) -> list[int]:
        """The offsets of `ids`, which follow those fed before; `text`: the choice's text so far,
        when it is known (an echoed prompt)."""
        offsets = []
        for t in ids:
            if self.tokenizer is None:  # no tokenizer, no text
                offsets.append(0)
                continue
            raw = token_bytes(self.tokenizer, t)
            if self._utf8.getstate()[0] and not (raw and 0x80 <= raw[0] < 0xC0):
                # the bytes held can no longer complete a character: they are text (U+FFFD) before t
                self.chars += len(self._utf8.decode(b"", final=True))
            offsets.append(self.chars)
            if t in self.special_ids and not self._in_text(raw, text):
                continue
            self.chars += len(self._utf8.decode(raw))
        return offsets

    def _in_text(self, special: bytes, text: str | None) -> bool:
        if text is None:
            return not self.skip
        return text.startswith(special.decode(errors="replace"), self.chars)


def completion_logprobs(
    tokenizer,
    ids: Sequence[int],
    entries: Sequence[dict[int, float] | None],
    text_offset: Sequence[int],
) -> dict[str, Any]:
    """The legacy completions format: tokens, their logprobs, the top-n per position (null for a
    position without any: an echoed prompt's first token) and where each token starts in the text
    (`TextOffsets`)."""

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
        "text_offset": list(text_offset),
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
