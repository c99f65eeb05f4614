"""Vocabulary-parallel embedding and output head: each rank holds `ceil(vocab / tp)` rows."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hylo.distributed.parallel import SINGLE, Parallel
from hylo.ops.gemm import linear


class VocabEmbedding(nn.Embedding):
    """`nn.Embedding` over this rank's rows (`Parallel.vocab_span`): a token outside them embeds to
    zeros here, and the all-reduce adds the rank that holds it. One rank: a plain embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel = SINGLE):
        self.lo, hi = parallel.vocab_span(vocab_size)
        super().__init__(hi - self.lo, hidden_size)
        self.parallel = parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return super().forward(ids)
        local = ids - self.lo
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.parallel.all_reduce(x.masked_fill(outside[..., None], 0))


class VocabHead(nn.Module):
    """The output projection over this rank's vocabulary rows. `forward` returns every rank the full
    logits `[T, vocab]` (gathered); `argmax` the greedy tokens with only each rank's best (logit, id)
    pair exchanged."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: Parallel = SINGLE):
        super().__init__()
        lo, hi = parallel.vocab_span(vocab_size)
        if vocab_size >= 1 << 24:
            raise ValueError(f"vocab_size ({vocab_size}) must be below 2^24 (token ids travel as fp32)")
        self.vocab_size, self.lo, self.parallel = vocab_size, lo, parallel
        self.weight = nn.Parameter(torch.empty(hi - lo, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        return self.parallel.all_gather(logits)[..., : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """`forward(hidden).argmax(-1)` without the full logits: each rank's best row and its logit,
        exchanged in one gather, then the best of those (ties to the lowest id, as `argmax`)."""
        logits = linear(hidden, self.weight)
        if self.parallel.size == 1:
            return logits.argmax(-1)
        valid = self.vocab_size - self.lo  # rows past the vocabulary (the last rank's padding) never win
        best, index = logits[..., :valid].float().max(-1)
        # (logit, id) pairs as fp32: ids below 2^24 are exact
        pairs = self.parallel.all_gather(torch.stack([best, (index + self.lo).float()], -1))
        pairs = pairs.unflatten(-1, (self.parallel.size, 2))  # [..., tp, (logit, id)]
        winner = pairs[..., 0].argmax(-1, keepdim=True)
        return pairs[..., 1].gather(-1, winner)[..., 0].long()
