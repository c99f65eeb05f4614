"""The torch reference of an MTP verify block's inputs (`block_inputs`): what `MTPProposer` feeds its
layer after a uniform verify forward, and the positions of its chained drafting steps."""

from __future__ import annotations

from typing import NamedTuple

import torch


class VerifiedBlocks(NamedTuple):
    """A uniform verify batch of B sequences of W tokens after the target's forward, as the MTP proposer
    reads it: `features [B·W, H]` (the target's captured features), `input_ids [B·W]`, `positions [B·W]`
    and `pad_index [B, W]` the batch's; `counts [B]` how many of each block's tokens were committed,
    `anchors [B]` the token picked after them."""

    features: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    pad_index: torch.Tensor
    counts: torch.Tensor
    anchors: torch.Tensor

    @property
    def width(self) -> int:
        return self.pad_index.shape[1]


class BlockInputs(NamedTuple):
    """An MTP forward over each sequence's verify block plus one column (see `block_inputs`).

    `hidden [B, W+1, H]`: the sequence's last committed hidden before the block, then the target's
    features of the block's W tokens; `tokens [B·(W+1)]`: the block's tokens and a copy of its last,
    with the anchor at column `counts[b]` (the token the target picked after the committed ones);
    `prefix [B]`: the position before the block's first token (0 at the start); `first [B]`: the row of
    `hidden.flatten(0, 1)` whose MTP output drafts step 0 (`b·(W+1) + counts[b]`); `chain [S, B]`: the
    position of chained step s + 1 (`start + counts - 1 + s + 1`, at most `last`)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    prefix: torch.Tensor
    first: torch.Tensor
    chain: torch.Tensor


def block_inputs(
    verified: VerifiedBlocks, last_hidden: torch.Tensor, rows: torch.Tensor, chain_steps: int, last: int
) -> BlockInputs:
    """The inputs of an MTP forward over the `verified` blocks of the sequences at table rows `rows [B]`,
    with `chain_steps` chained steps after it (positions at most `last`). Also sets `last_hidden[rows[b]]`
    to the feature of sequence b's last committed token (the first token's when none was), after reading
    the old rows into `hidden[:, 0]`."""
    features, input_ids, positions, pad_index, counts, anchors = verified
    blocks, width = rows.shape[0], verified.width
    counts = counts.long()
    offsets = pad_index[:, 0]
    starts = positions[offsets]
    hidden = torch.cat([last_hidden[rows][:, None], features.view(blocks, width, -1)], 1)
    tokens = input_ids.view(blocks, width)
    tokens = torch.cat([tokens, tokens[:, -1:]], 1).scatter(1, counts[:, None], anchors[:, None])
    last_hidden[rows] = features[offsets + counts.clamp(min=1) - 1]
    first = torch.arange(blocks, device=rows.device) * (width + 1) + counts
    steps = torch.arange(1, chain_steps + 1, device=rows.device)
    chain = (starts + counts - 1 + steps[:, None]).clamp(max=last)
    return BlockInputs(hidden, tokens.flatten(), (starts - 1).clamp(min=0), first, chain)
