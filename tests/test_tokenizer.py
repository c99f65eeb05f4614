import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from hylo.tokenizer import IncrementalDetokenizer, Tokenizer, write_byte_level_tokenizer

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]
RENDERED = "[gMASK]<sop><|system|>\nBe terse.<|user|>\nHi<|assistant|>\nHello!"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo")
    write_byte_level_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def _copy_with_config(demo_dir: Path, dest: Path, **changes: object) -> Path:
    """Copies the demo tokenizer into ``dest`` with tokenizer_config.json keys replaced."""
    shutil.copy(demo_dir / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    config.update(changes)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def _random_text(rng: random.Random, n_pieces: int) -> str:
    pieces = [
        "the",
        " engine",
        " tokens",
        "hello",
        " ",
        "\n",
        "你好",
        "世界",
        "😀",
        "🚀",
        "é",
        "ü",
        "ß",
        "->",
        "42",
    ]
    return "".join(rng.choice(pieces) for _ in range(n_pieces))


# --- encode / decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["Hello, world! The engine streams tokens.", "你好，世界", "emoji 😀🚀 mixed 日本語 é ü", ""]
)
def test_roundtrip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_vocab_layout(tok: Tokenizer) -> None:
    assert tok.vocab_size <= 512
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert [tok.id_to_token(i) for i in range(256)] == alphabet
    for s in SPECIALS:
        i = tok.token_to_id(s)
        assert i is not None and tok.id_to_token(i) == s
    assert tok.token_to_id("<|no such token|>") is None
    assert tok.eos_token_ids == [tok.token_to_id("<|endoftext|>")]
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id == tok.token_to_id("<sop>")


def test_merges_compress_corpus_words(tok: Tokenizer) -> None:
    assert len(tok.encode(" the engine")) < len(" the engine")


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>\nhi<|endoftext|>")
    assert tok.token_to_id("<|user|>") in ids and tok.token_to_id("<|endoftext|>") in ids
    assert tok.decode(ids) == "\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>\nhi<|endoftext|>"


def test_add_bos_token(demo_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path, add_bos_token=True))
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_write_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert write_byte_level_tokenizer(a) == write_byte_level_tokenizer(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()


# --- incremental detokenizer -----------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random | None, **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(tok, kwargs.pop("prompt_ids", []), **kwargs)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        chunks.append(detok.step(ids[i : i + n]))
        i += n
    assert detok.text == "".join(chunks)
    return chunks


def test_stream_splits_multibyte_characters(tok: Tokenizer) -> None:
    # Guards the premise of the streaming tests: single tokens carry partial characters.
    assert any(tok.decode([i]).endswith("\ufffd") for i in tok.encode("你好😀"))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_matches_full_decode(tok: Tokenizer, seed: int, grouped: bool) -> None:
    rng = random.Random(seed)
    ids = tok.encode(_random_text(rng, 60))
    prompt = tok.encode(_random_text(rng, 5)) if seed % 2 else []
    chunks = _stream(tok, ids, rng if grouped else None, prompt_ids=prompt)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids)


def test_detokenizer_holds_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("你")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["你"]


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("你好<|user|>\nok 😀<|endoftext|>")
    chunks = _stream(
        tok, ids, None, prompt_ids=tok.encode("[gMASK]<sop><|assistant|>\n"), skip_special_tokens=skip
    )
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|user|>" in "".join(chunks)) is not skip


def test_detokenizer_window_is_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: list[int] = []
    real_decode = tok.decode

    def recording_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording_decode)
    ids = tok.encode("the engine 你好 " * 100)
    _stream(tok, ids, None, prompt_ids=ids[:50])
    assert max(lengths) <= 10


# --- chat template ---------------------------------------------------------------------------------


def test_chat_template_renders_conversation(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == RENDERED
    assert tok.apply_chat_template(CONVERSATION) == RENDERED + "<|assistant|>\n"


def test_chat_template_text_parts_tools_and_roles(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "[gMASK]<sop><|user|>\nHello"
    tools = [{"name": "天气", "parameters": {}}]
    rendered = tok.apply_chat_template([{"role": "tool", "content": "42"}], tools=tools)
    assert rendered == (
        '[gMASK]<sop><|system|>\nYou can call these tools:\n{"name": "天气", "parameters": {}}'
        "<|observation|>\n42<|assistant|>\n"
    )
    with pytest.raises(ValueError, match="unsupported role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"role": "user"}, "message 1 field 'content'"),
        ({"role": 7, "content": "x"}, "message 1 field 'role'"),
        ({"role": "user", "content": 3}, "message 1 field 'content'"),
        ({"role": "user", "content": [{"type": "image", "url": "x"}]}, "message 1 field 'content'"),
        ("just text", "message 1 must be a dict"),
    ],
)
def test_bad_message_names_index(tok: Tokenizer, bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template([CONVERSATION[0], bad])


def test_missing_chat_template(demo_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_named_chat_templates_use_default(demo_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"},
    ]
    tok = Tokenizer.from_dir(_copy_with_config(demo_dir, tmp_path, chat_template=templates))
    assert tok.apply_chat_template(CONVERSATION) == "[system][user][assistant]"


def test_chat_template_jinja_file_wins(demo_dir: Path, tmp_path: Path) -> None:
    _copy_with_config(demo_dir, tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}|{{ eos_token }}|{{ extra }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(CONVERSATION, extra="x") == "<sop>|<|endoftext|>|x"


# --- loading ---------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "tokenizer.json"])
def test_malformed_json_names_file(demo_dir: Path, tmp_path: Path, name: str) -> None:
    _copy_with_config(demo_dir, tmp_path)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("as_list", [False, True])
def test_generation_config_eos(demo_dir: Path, tmp_path: Path, as_list: bool) -> None:
    _copy_with_config(demo_dir, tmp_path)
    eos = Tokenizer.from_dir(demo_dir).eos_token_ids[0]
    gen_eos = [5, eos, 6, 5] if as_list else 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == ([eos, 5, 6] if as_list else [eos, 5])
