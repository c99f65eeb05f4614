"""The torch reference of a DFlash step's index arithmetic (`DFlashProposer.observe` and `propose`): which
cache slots a forward's committed tokens write their draft K/V to, and the next draft blocks' rows, context
lengths, tokens and positions."""

from __future__ import annotations

from typing import NamedTuple

import torch


class CommittedTokens(NamedTuple):
    """A forward's packed tokens and what it committed: `token_seq [T]` (each token's sequence),
    `pad_index [S, ·]` (column 0: each sequence's first packed token), `positions [T]`, `new_slots [T]`
    (each token's cache slot), `counts [S]` (tokens committed per sequence: the first ones of its chunk)."""

    token_seq: torch.Tensor
    pad_index: torch.Tensor
    positions: torch.Tensor
    new_slots: torch.Tensor
    counts: torch.Tensor


class DraftBlocks(NamedTuple):
    """The next draft blocks, one per sampling sequence: `rows [S']` (table row = state slot), `lengths
    [S']` (context tokens: committed so far), `tokens [S', W]` (the anchor, then the mask token) and
    `positions [S', W]` (lengths + 0..W-1)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor


def committed_slots(committed: CommittedTokens) -> torch.Tensor:
    """`[T]`: each packed token's cache slot where it is among its sequence's first `counts` tokens, else -1
    (not written)."""
    seq = committed.token_seq
    within = torch.arange(seq.shape[0], device=seq.device) - committed.pad_index[seq, 0]
    return torch.where(within < committed.counts[seq], committed.new_slots, -1)


def draft_blocks(
    committed: CommittedTokens, state_slots: torch.Tensor, sampling: torch.Tensor, anchors: torch.Tensor,
    width: int, mask_token_id: int,
) -> DraftBlocks:  # fmt: skip
    """The blocks of the sequences `sampling [S']`: each right after its committed tokens, [anchor, mask ×
    (width − 1)] (`anchors [S]`, int64)."""
    rows = state_slots[sampling]
    lengths = committed.positions[committed.pad_index[sampling, 0]] + committed.counts[sampling]
    tokens = torch.full((sampling.shape[0], width), mask_token_id, device=sampling.device)
    tokens[:, 0] = anchors[sampling]
    positions = lengths[:, None] + torch.arange(width, device=sampling.device)
    return DraftBlocks(rows, lengths, tokens, positions)
