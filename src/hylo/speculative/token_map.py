"""Speculative token maps: the token ids a draft may propose (SGLang's `--speculative-token-map`).

A draft that picks only among the most frequent tokens reads that many rows of the vocabulary head
per drafted token instead of all of them (GLM-5.3-Flash: 32K of 154,880 rows is 0.27 of the 1.27 GB
bf16 head, read by each of MTP's chained steps). The target verifies every draft against its full
vocabulary, so outputs never change; a draft whose true token is outside the map is simply rejected.

The file is a 1-D integer tensor saved by `torch.save` (`.pt`, the layout SGLang reads) or a JSON list
of ids (`.json`); `hot_tokens` makes one from token sequences (`hylo token-map`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

FIELD = "speculative_token_map"


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The sorted distinct token ids in `path` (int64, CPU); a `ValueError` naming the field and the
    file says what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{FIELD} {path}: no such file")
    try:
        if path.suffix == ".json":
            ids = torch.tensor(json.loads(path.read_text()))
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
            ids = torch.as_tensor(ids)
    except Exception as e:  # a file torch or json cannot read, of any kind
        raise ValueError(f"{FIELD} {path}: not a saved tensor or JSON list of token ids ({e})") from e
    integer = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    if ids.ndim != 1 or not ids.numel() or not integer:
        raise ValueError(
            f"{FIELD} {path}: must hold a non-empty 1-D list of integer token ids, got {ids.dtype} "
            f"of shape {tuple(ids.shape)}"
        )
    ids = ids.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{FIELD} {path}: token ids must lie in [0, {vocab_size}), got {low}..{high}")
    unique = ids.unique()  # sorted
    if unique.numel() != ids.numel():
        raise ValueError(f"{FIELD} {path}: {ids.numel() - unique.numel()} token ids appear more than once")
    return unique


def hot_tokens(sequences: Iterable[Sequence[int]], count: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `count` most frequent ids of `sequences` (ties to the lower id), with `always` (e.g. the
    stop tokens) among them, sorted: a token map for `save_token_map`."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    frequency = Counter(t for seq in sequences for t in seq)
    ranked = sorted(frequency, key=lambda t: (-frequency[t], t))
    chosen = list(dict.fromkeys([*always, *ranked]))[:count]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(ids: torch.Tensor, sequences: Iterable[Sequence[int]]) -> float:
    """The share of the tokens of `sequences` that are among `ids` (0 for no tokens)."""
    kept = set(ids.tolist())
    counted = [t in kept for seq in sequences for t in seq]
    return sum(counted) / max(1, len(counted))


def save_token_map(ids: torch.Tensor, path: str | Path) -> Path:
    """Write `ids` where `load_token_map` reads them: `.json` as a list, anything else `torch.save`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(ids.tolist()) + "\n")
    else:
        torch.save(ids.clone(), path)
    return path
