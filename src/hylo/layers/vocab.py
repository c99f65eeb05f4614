"""Vocabulary-parallel embedding and output head: each rank holds `ceil(vocab / tp)` rows."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hylo.ops.gemm import linear
from hylo.parallel.layout import SINGLE, Parallel, TokenShards


class VocabEmbedding(nn.Embedding):
    """`nn.Embedding` over this rank's rows (`Parallel.vocab_span`): a token outside them embeds to
    zeros here, and the all-reduce adds the rank that holds it. One rank: a plain embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel = SINGLE):
        self.lo, hi = parallel.vocab_span(vocab_size)
        # uninitialised: the loader fills it; nn.Embedding's normal_ under the meta-device context goes
        # through torch._refs, whose first call imports torch._dynamo (seconds at every start-up)
        super().__init__(hi - self.lo, hidden_size, _weight=torch.empty(hi - self.lo, hidden_size))
        self.parallel = parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return super().forward(ids)
        return self.parallel.all_reduce(self._partial(ids))

    def _partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows' embeddings of `ids`, zeros for the ids other ranks hold."""
        local = ids - self.lo
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return x.masked_fill(outside[..., None], 0)

    def streams(self, ids: torch.Tensor, copies: int, shards: TokenShards | None = None) -> torch.Tensor:
        """`forward(ids)` repeated `copies` times per token, `[T, copies, hidden]` contiguous (an mHC
        model's first residual streams): on one rank a single gather from the weight viewed `copies`
        times (no embedding then copy), elsewhere the embedding expanded; with `shards`, this rank's
        tokens alone (`[shards.local, copies, hidden]`, the embedding's sum reduce-scattered)."""
        if self.parallel.size == 1:
            return self.weight[:, None, :].expand(-1, copies, -1)[ids].contiguous()
        x = self(ids) if shards is None else self.parallel.reduce_scatter_rows(self._partial(ids), shards)
        return x[:, None, :].expand(-1, copies, -1).contiguous()


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
        return _best_of_ranks(self.parallel, best, index + self.lo)

    def restricted(self, token_ids: torch.Tensor) -> HotTokenHead:
        """This head over `token_ids` only (sorted, distinct, inside the vocabulary): see `HotTokenHead`."""
        return HotTokenHead(self, token_ids)


class HotTokenHead(nn.Module):
    """An output head that only ever picks tokens of a fixed set (a speculative "token map", as SGLang's
    `--speculative-token-map`): the draft reads `len(token_ids)` rows of the head instead of the whole
    vocabulary, and the target still verifies every token, so outputs are unchanged; only drafts whose
    true token lies outside the set are lost.

    `weight` copies this rank's rows of the set (`ids` their global token ids); a rank holding none of
    them keeps one row that never wins. `argmax` returns global token ids like `VocabHead.argmax`;
    `forward` the full logits `[..., vocab]` with `-inf` outside the set (what a selector's top-k reads)."""

    def __init__(self, head: VocabHead, token_ids: torch.Tensor):
        super().__init__()
        ids = token_ids.long().cpu()  # checked on the host, then moved once
        if ids.ndim != 1 or not ids.numel() or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("token_ids must be a non-empty sorted 1-D tensor of distinct ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= head.vocab_size:
            span = f"{int(ids[0])}..{int(ids[-1])}"
            raise ValueError(f"token_ids must lie in [0, {head.vocab_size}), got {span}")
        ids = ids.to(head.weight.device)
        self.vocab_size, self.lo, self.parallel = head.vocab_size, head.lo, head.parallel
        self.rows = head.weight.shape[0]
        local = ids[(ids >= head.lo) & (ids < head.lo + self.rows)]
        self.empty = not local.numel()  # this rank holds none of the set
        if self.empty:
            local = ids.new_tensor([head.lo])
        self.weight = nn.Parameter(head.weight.detach()[local - head.lo].clone(), requires_grad=False)
        self.register_buffer("ids", local, persistent=False)
        self.register_buffer("local_rows", local - head.lo, persistent=False)  # where forward scatters

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        return torch.full_like(logits, float("-inf")) if self.empty else logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)
        full = logits.new_full((*logits.shape[:-1], self.rows), float("-inf"))
        full[..., self.local_rows] = logits
        return self.parallel.all_gather(full)[..., : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)
        if self.parallel.size == 1:
            return self.ids[logits.argmax(-1)]
        best, index = logits.float().max(-1)
        return _best_of_ranks(self.parallel, best, self.ids[index])


def _best_of_ranks(parallel: Parallel, best: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The id of the highest of the ranks' `best` logits (ties to the lowest rank, which holds the
    lowest ids), from one gather of (logit, id) pairs as fp32 (ids below 2^24 are exact)."""
    pairs = parallel.all_gather(torch.stack([best, ids.float()], -1))
    pairs = pairs.unflatten(-1, (parallel.size, 2))  # [..., tp, (logit, id)]
    winner = pairs[..., 0].argmax(-1, keepdim=True)
    return pairs[..., 1].gather(-1, winner)[..., 0].long()
