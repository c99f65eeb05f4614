"""The torch reference of a verify block's greedy acceptance (`accepted_prefix`)."""

from __future__ import annotations

import torch


def accepted_prefix(
    picks: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block (row) of `picks [V, T]` (the target's pick after the anchor and after each draft) and
    `drafts [V, T-1]`: (`accepted [V]` int64, the length of the longest prefix of the drafts equal to
    the picks before them, among the first `num_drafts [V]` (None: all T-1); `committed [V]` int32,
    accepted + 1, the tokens the block commits; `anchors [V]` int64, the pick after the last accepted
    draft, the next block's anchor)."""
    steps = torch.arange(drafts.shape[1], device=drafts.device)
    keep = picks[:, :-1] == drafts
    if num_drafts is not None:
        keep &= steps[None, :] < num_drafts[:, None]
    accepted = keep.int().cumprod(1).sum(1)
    return accepted, (accepted + 1).int(), picks.gather(1, accepted[:, None])[:, 0]
