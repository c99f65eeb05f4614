"""Text <-> token ids for a model directory (HF ``tokenizer.json`` layout, no ``transformers``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, trainers

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON in {path}: {exc}") from exc


def _token_content(value: Any) -> str | None:
    """HF configs store special tokens either bare or as serialized ``AddedToken`` dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells byte b as one printable character: itself when it is printable
    (outside space and the C0/C1 controls), else chr(256 + k) for the k-th unprintable byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Overrides jinja's builtin, which HTML-escapes and would mangle prompts.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _validate_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Returns shallow copies whose ``content`` is always a ``str`` (text parts joined; an assistant
    message with ``tool_calls`` may have none: then it is empty)."""
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} field 'role' must be a string")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise ValueError(f"message {i} field 'content' parts must be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        elif content is None and message.get("role") == "assistant" and message.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"message {i} field 'content' must be a string or a list of text parts")
        checked.append({**message, "content": content})
    return checked


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of one model directory.

    Invariant: every id attribute is either ``None`` or a valid id of the underlying tokenizer.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        generation_eos: Sequence[int] = (),
        chat_template: str | None = None,
        name: str = "model",
    ) -> None:
        config = config or {}
        self._tok = tokenizer
        self.name = name
        # Fallback for ids that only tokenizer_config.json knows about (rare, but HF honours it).
        self._added: dict[str, int] = {
            str(entry["content"]): int(i) for i, entry in config.get("added_tokens_decoder", {}).items()
        }
        self.bos_token, self.eos_token, self.pad_token = (
            _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS
        )
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.chat_template = chat_template
        self.bos_token_id = self._special_id(self.bos_token)
        self.pad_token_id = self._special_id(self.pad_token)
        eos = [self._special_id(self.eos_token), *generation_eos]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads ``tokenizer.json`` and the optional config files next to it."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (looked for {tok_file})")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a bare Exception on parse errors
            raise ValueError(f"malformed JSON in {tok_file}: {exc}") from exc
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # transformers 5 writes the template to its own file, which supersedes the config entry.
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        gen_file = path / "generation_config.json"
        gen_eos = _read_json(gen_file).get("eos_token_id") if gen_file.is_file() else None
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(tokenizer, config, gen_eos, template, name=str(path))

    def _special_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encodes ``text``; ``add_bos_token`` from the config overrides the post-processor's choice."""
        # encode_batch releases the GIL (encode does not), so a server thread tokenising a long
        # prompt leaves the event loop running.
        (enc,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = enc.ids
        if not add_special_tokens or self.add_bos_token is None or self.bos_token_id is None:
            return ids
        # The special-tokens mask tells a post-processor BOS apart from one spelled out in ``text``.
        has_bos = bool(ids) and ids[0] == self.bos_token_id and enc.special_tokens_mask[0] == 1
        if self.add_bos_token and not has_bos:
            return [self.bos_token_id, *ids]
        if not self.add_bos_token and has_bos:
            return ids[1:]
        return ids

    def encodings(self, texts: Sequence[str]) -> list[tokenizers.Encoding]:
        """The encodings (ids, character offsets) of ``texts``, computed in parallel; their ids equal
        ``encode(text)``'s unless the config sets ``add_bos_token``, which they ignore."""
        return self._tok.encode_batch(list(texts))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for; a byte-level token may hold part of a UTF-8 character,
        which ``decode`` would turn into U+FFFD."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:  # SentencePiece byte fallback
            return bytes([int(byte[1], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def special_ids(self) -> list[int]:
        """Ids of the added tokens marked special (chat markers, eos, ...): never part of text."""
        return sorted(i for i, added in self._tok.get_added_tokens_decoder().items() if added.special)

    def token_to_id(self, s: str) -> int | None:
        i = self._tok.token_to_id(s)
        return self._added.get(s) if i is None else i

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders the chat template; extra ``kwargs`` become template variables (and may override)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template; pass plain text instead")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = _tojson
            self._compiled = env.from_string(self.chat_template)
        variables = {
            "messages": _validate_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "tools": tools,
            **kwargs,
        }
        return self._compiled.render(**variables)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one chunk per ``step``.

    Invariants: no chunk ends in a partial UTF-8 character (held back while the tail decodes to
    U+FFFD); no text is emitted twice; once the stream ends on a complete character, the
    concatenation of chunks equals ``tokenizer.decode(generated_ids)``. Each step decodes only a
    window: the previously emitted chunk's tokens (the prefix, which gives the decoder its context,
    e.g. for leading-space handling) plus the not-yet-emitted ones, so cost is O(window), not O(total).
    """

    # Prompt tokens kept as decoding context for the first generated token.
    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self._PROMPT_CONTEXT :]) if prompt_ids else []
        # The window: ids[:read] were already emitted (or are prompt) and serve as context only.
        self._read = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Appends ``new_token_ids`` and returns the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        context = self._tokenizer.decode(self._ids[: self._read], self._skip)
        full = self._tokenizer.decode(self._ids, self._skip)
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return ""
        chunk = full[len(context) :]
        # The chunk's tokens become the next context; older ones are dropped so memory stays O(window).
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._text += chunk
        return chunk


DEMO_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)

# Merges are learned from this fixed text so the demo vocabulary is reproducible without a download.
_DEMO_CORPUS = """\
A serving engine turns a stream of requests into a stream of tokens. Each request arrives with a
prompt, the engine encodes the prompt into token ids, and the model predicts the next token again
and again until it emits an end-of-text token or reaches the length limit the client asked for.

The hard part is doing this for many requests at once. Prompts differ in length, answers differ in
length, and the memory that holds the attention state of one request must be returned the moment
that request finishes, so that the next one in the queue can start without waiting for the others.

Hybrid models mix layers of linear attention, whose state has a fixed size, with layers of sparse
attention, which look back at a few selected blocks of the history. Mixture-of-experts layers send
each token to a small number of experts, so the model is large but the work per token stays small.

Speculative decoding guesses several tokens ahead with a cheap draft and then checks the whole
block with the full model in a single pass. When the guesses are right, the engine moves forward by
many tokens for the price of one step; when they are wrong, it keeps the correct prefix and retries.
"""

# The tokens that end an assistant turn in the demo chat format (the models' eos ids).
DEMO_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

_DEMO_MERGE_VOCAB = 384  # 256 byte symbols + 128 merges; specials come on top.

DEMO_CHAT_TEMPLATE = """\
[gMASK]<sop>
{%- if tools %}<|system|>
You can call these tools:
{%- for tool in tools %}

{{ tool | tojson }}
{%- endfor %}
{%- endif %}
{%- for message in messages %}
{%- if message.role in ['system', 'user', 'assistant'] %}<|{{ message.role }}|>
{% elif message.role == 'tool' %}<|observation|>
{% else %}{{ raise_exception('unsupported role: ' + message.role) }}{% endif %}
{{- message.content }}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


def write_byte_level_bpe(
    directory: Path,
    texts: Iterable[str],
    merge_vocab: int,
    special_tokens: Sequence[str] = DEMO_SPECIAL_TOKENS,
    extra_config: dict[str, str] | None = None,
    show_progress: bool = False,
) -> int:
    """Trains a byte-level BPE of ``merge_vocab`` symbols on ``texts`` and writes it into ``directory``
    (``tokenizer.json`` + ``tokenizer_config.json`` with the demo's bos/eos/pad, ``extra_config`` and
    chat template); returns the vocab size, specials included.

    Invariants: ids 0-255 are the byte symbols, then the learned merges, then ``special_tokens`` in
    order; the output is byte-identical across calls and processes for the same ``texts`` (the
    trainer's tie-breaks are deterministic and every file is serialized in a fixed order).
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=merge_vocab,
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(list(special_tokens))
    config = {
        "bos_token": "<sop>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        **(extra_config or {}),
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)


def write_byte_level_tokenizer(directory: Path) -> int:
    """Writes the demo model's byte-level BPE tokenizer into ``directory``; returns its vocab size.

    Invariant: the output is byte-identical across calls and processes; the total stays <= 512.
    """
    return write_byte_level_bpe(directory, _DEMO_CORPUS.split("\n\n"), _DEMO_MERGE_VOCAB)
