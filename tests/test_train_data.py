import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from hylo.tokenizer import Tokenizer, write_byte_level_tokenizer
from hylo.train import data
from hylo.train.bpe import MASK_TOKEN, SPECIAL_TOKENS, train_tokenizer
from hylo.train.data import Conversation

VOCAB = 512
_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "do", "an", "el", "is", "or"]


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(300)]
    return [" ".join(rng.choices(words, k=40)) + rng.choice([".", "?", "!\n\n"]) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(_corpus(), tmp_path_factory.mktemp("bpe"), vocab_size=VOCAB)


def _conv(conv_id: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(conv_id, tuple({"role": r, "content": c} for r, c in turns))


CHAT = _conv(
    "chat_0",
    ("system", "Be terse."),
    ("user", "Why is the sky blue?"),
    ("assistant", "Rayleigh scattering: kalo mine é 日本 🙂."),
    ("user", "And sunsets?"),
    ("assistant", "\n\n  Longer path, so red remains."),
)


# --- the tokenizer ---------------------------------------------------------------------------


def test_train_tokenizer_layout(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    # specials are the last ids, in order, the mask token last
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(VOCAB - len(SPECIAL_TOKENS), VOCAB))
    assert tok.token_to_id(MASK_TOKEN) == VOCAB - 1
    assert tok.bos_token == "<sop>" and tok.eos_token == tok.pad_token == "<|endoftext|>"
    config = json.loads((Path(tok.name) / "tokenizer_config.json").read_text())
    assert config["mask_token"] == MASK_TOKEN
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"


ROUND_TRIP = ["kalo mine sutari.", "  two  spaces\n\ttab", "é 日本語 🙂 ünïcödé", "x" * 50]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_train_tokenizer_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_train_tokenizer_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        train_tokenizer(_corpus(), tmp_path / name, vocab_size=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_train_tokenizer_refuses_what_it_cannot_fill(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="symbols"):
        train_tokenizer(["ab"], tmp_path / "small", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no room"):
        train_tokenizer(_corpus(), tmp_path / "tiny", vocab_size=256)


def test_demo_tokenizer_unchanged(tmp_path: Path) -> None:
    # sha256 of what write_byte_level_tokenizer wrote before it shared its code with train_tokenizer
    expected = {
        "tokenizer.json": "72306117d2a7002499e5e11c9eb97c79aec13d6b5ebc1f5b08716cc785b613b1",
        "tokenizer_config.json": "e8e33554e135dd2f0d6b966a72fb6df48c340a156e003e16ddf31135aa567fec",
    }
    assert write_byte_level_tokenizer(tmp_path) == 391
    assert {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in expected} == expected


# --- loading ---------------------------------------------------------------------------------


def _load(monkeypatch: pytest.MonkeyPatch, *entries: list[tuple[str, str]], limit=None) -> list[Conversation]:
    raw = [
        {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}
        for i, turns in enumerate(entries)
    ]
    monkeypatch.setattr(data, "sharegpt_entries", lambda: iter(raw))
    return data.load_conversations(limit)


def _roles(conversation: Conversation) -> list[str]:
    return [m["role"] for m in conversation.messages]


def test_load_cleans_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _load(
        monkeypatch,
        [("system", "S"), ("human", "q"), ("gpt", "a"), ("human", "q2")],  # trailing question cut
        [("human", "q"), ("gpt", ""), ("gpt", "a"), ("human", "q2"), ("bing", "b"), ("gpt", "a2")],
        [("gpt", "a"), ("human", "q"), ("gpt", "a")],  # starts with a reply: dropped
        [("human", "q"), ("human", "q again"), ("gpt", "a")],  # no alternation from the start
        [("human", "q")],  # no reply
        [("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", "ends with <|endoftext|>")],
        [("human", "q"), ("gpt", "a"), ("system", "late"), ("gpt", "a2")],
    )
    assert [c.id for c in loaded] == ["c0", "c1", "c5", "c6"]
    assert _roles(loaded[0]) == ["system", "user", "assistant"]
    assert loaded[1].messages == ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    assert _roles(loaded[2]) == _roles(loaded[3]) == ["user", "assistant"]


def test_load_limit_counts_kept_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [[("gpt", "a")], *[[("human", f"q{i}"), ("gpt", "a")] for i in range(5)]]
    assert [c.id for c in _load(monkeypatch, *entries, limit=2)] == ["c1", "c2"]


def test_load_real_dataset_prefix() -> None:
    conversations = data.load_conversations(limit=200)
    assert len(conversations) == 200
    assert len({c.id for c in conversations}) == 200
    for c in conversations:
        roles = _roles(c)
        body = roles[1:] if roles[0] == "system" else roles
        assert body == ["user", "assistant"] * (len(body) // 2) and body
        assert all(m["content"].strip() for m in c.messages)
    train, held_out = data.split(conversations)
    assert len(train) + len(held_out) == 200


# --- the split -------------------------------------------------------------------------------


def _many(n: int) -> list[Conversation]:
    return [_conv(f"id{i // 3}_{i % 3}", ("user", "q"), ("assistant", "a")) for i in range(n)]


def test_split_is_deterministic_disjoint_and_order_independent() -> None:
    conversations = _many(6000)
    train, held_out = data.split(conversations)
    assert data.split(conversations) == (train, held_out)
    assert {c.id for c in train}.isdisjoint(c.id for c in held_out)
    assert len(train) + len(held_out) == len(conversations)
    expected = data.HELD_OUT_FRACTION * len(conversations)
    assert 0.5 * expected <= len(held_out) <= 1.5 * expected
    shuffled = random.Random(1).sample(conversations, len(conversations))
    assert {c.id for c in data.split(shuffled)[1]} == {c.id for c in held_out}
    # a subset (a smaller `limit`) holds out exactly its share of the same conversations
    assert data.split(conversations[:1000])[1] == [c for c in held_out if c in conversations[:1000]]


def test_split_keeps_the_parts_of_a_chat_together() -> None:
    _, held_out = data.split(_many(6000))
    chats = {data.source_id(c.id) for c in held_out}
    assert {f"{chat}_{part}" for chat in chats for part in range(3)} == {c.id for c in held_out}
    assert data.source_id("a_b_12") == "a_b" and data.source_id("plain") == "plain"


def test_split_depends_on_the_seed() -> None:
    conversations = _many(3000)
    assert data.split(conversations, seed=1)[1] != data.split(conversations, seed=2)[1]
    assert data.split(conversations, fraction=0.0)[1] == []
    assert data.split(conversations, fraction=1.0)[0] == []


# --- encoding --------------------------------------------------------------------------------


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of True."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_encode_conversation_is_the_full_render(tok: Tokenizer) -> None:
    ids, mask = data.encode_conversation(tok, CHAT)
    rendered = tok.apply_chat_template(list(CHAT.messages), add_generation_prompt=False)
    eos = tok.token_to_id("<|endoftext|>")
    assert ids == [*tok.encode(rendered), eos]
    assert len(mask) == len(ids)


def test_encode_conversation_masks_exactly_the_replies(tok: Tokenizer) -> None:
    ids, mask = data.encode_conversation(tok, CHAT)
    replies = [m["content"] for m in CHAT.messages if m["role"] == "assistant"]
    runs = _runs(mask)
    assert len(runs) == len(replies)
    enders = [tok.token_to_id("<|user|>"), tok.token_to_id("<|endoftext|>")]
    for (start, end), reply, ender in zip(runs, replies, enders, strict=True):
        assert ids[end - 1] == ender
        text = b"".join(tok.token_bytes(i) for i in ids[start : end - 1]).decode()
        # a reply's leading newline may merge with the one after <|assistant|>
        assert text in (reply, "\n" + reply)
    unmasked = b"".join(tok.token_bytes(i) for i, m in zip(ids, mask, strict=True) if not m).decode()
    assert "Rayleigh" not in unmasked and "Why is the sky blue?" in unmasked


def test_encode_all_matches_encode_conversation(tok: Tokenizer) -> None:
    conversations = [CHAT, _conv("x_0", ("user", "kalo"), ("assistant", "mine"))] * 3
    for (ids, mask), conversation in zip(data.encode_all(tok, conversations), conversations, strict=True):
        assert ids.dtype == np.uint16 and mask.dtype == bool
        assert (ids.tolist(), mask.tolist()) == data.encode_conversation(tok, conversation)


def test_prompt_ids_is_the_first_question(tok: Tokenizer) -> None:
    expected = "[gMASK]<sop><|system|>\nBe terse.<|user|>\nWhy is the sky blue?<|assistant|>\n"
    assert data.prompt_ids(tok, CHAT) == tok.encode(expected)
    no_system = _conv("y", *[(m["role"], m["content"]) for m in CHAT.messages[1:]])
    assert tok.decode(data.prompt_ids(tok, no_system), skip_special_tokens=False).startswith(
        "[gMASK]<sop><|user|>\nWhy"
    )


# --- packing ---------------------------------------------------------------------------------


def test_pack_cuts_the_eos_separated_stream() -> None:
    eos = 9
    windows = data.pack([[1, 2], [3, eos], [], [4, 5, 6]], length=3, eos=eos)
    # stream: 1 2 9 | 3 9 9 | 4 5 6 | 9 (dropped)
    assert windows.dtype == np.uint16
    assert windows.tolist() == [[1, 2, 9], [3, 9, 9], [4, 5, 6]]
    assert data.pack([[70000, 1]], length=2, eos=0).dtype == np.int32
    assert data.pack([], length=4, eos=0).shape == (0, 4)


def test_prompt_turns_takes_first_turns_first_and_every_later_turn_alone() -> None:
    def chat(id_: str, *texts: str, system: str | None = None) -> data.Conversation:
        roles = ("user", "assistant") * len(texts)
        messages = [{"role": r, "content": t} for r, t in zip(roles, texts, strict=False)]
        return data.Conversation(
            id_, tuple(([{"role": "system", "content": system}] if system else []) + messages)
        )

    conversations = [
        chat(
            "a", "What is a prime number?", "A number...", "Give an example please", "7", system="Be brief."
        ),
        chat("b", "  What is a prime number?  ", "Again...", "ok", "Fine."),  # a repeat, then a short turn
        chat("c", "Name three colours.", "Red, green, blue.", "Give an example please", "Red."),
    ]
    turns = data.prompt_turns(conversations)
    assert turns == [
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prime number?"}),
        ({"role": "user", "content": "Name three colours."},),
        ({"role": "user", "content": "Give an example please"},),
    ]
