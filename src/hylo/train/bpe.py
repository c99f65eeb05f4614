"""The trained demo model's tokenizer: a byte-level BPE learned from the training conversations."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hylo.tokenizer import DEMO_SPECIAL_TOKENS, Tokenizer, write_byte_level_bpe

# The token a DFlash draft reads at the positions it predicts in one block.
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (*DEMO_SPECIAL_TOKENS, MASK_TOKEN)

_BYTE_SYMBOLS = 256


def train_tokenizer(
    texts: Iterable[str], directory: Path, vocab_size: int = 8192, progress: bool = False
) -> Tokenizer:
    """Learns a byte-level BPE from ``texts``, writes it into ``directory`` and loads it back.

    Invariants: ``vocab_size`` counts the byte symbols, the merges and ``SPECIAL_TOKENS`` (the
    demo's chat markers plus ``MASK_TOKEN``, the last ids); any text that spells out no special
    token round-trips through encode/decode (each byte has a symbol); the same ``texts`` in the same
    order give byte-identical files. Raises ``ValueError`` when ``texts`` are too few to learn that
    many merges.
    """
    merge_vocab = vocab_size - len(SPECIAL_TOKENS)
    if merge_vocab <= _BYTE_SYMBOLS:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges")
    written = write_byte_level_bpe(
        directory,
        texts,
        merge_vocab,
        special_tokens=SPECIAL_TOKENS,
        extra_config={"mask_token": MASK_TOKEN},
        show_progress=progress,
    )
    if written != vocab_size:
        raise ValueError(f"the texts yield only {written - len(SPECIAL_TOKENS)} symbols, {merge_vocab} asked")
    return Tokenizer.from_dir(directory)
