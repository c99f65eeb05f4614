"""MTP proposer: keeps the MTP layer's DSA caches for every committed token and drafts by chaining
`num_steps` MTP forwards from the anchor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import load_mtp_layer
from hylo.models.mtp import MTPLayer
from hylo.speculative.proposer import Proposer, StepCommit


class MTPProposer(Proposer):
    """The MTP layer's latents, indexer keys, gates and pooled keys live in a `TokenCache` of their own
    indexed by the target's request table, with the entry for (h_i, token i+1) at position i (see
    `hylo.models.mtp`). `last_hidden[row]` keeps the target hidden of each request's last committed
    token, which pairs with the next token to arrive.

    Invariant: after `observe`, a request with n committed tokens has correct entries at positions
    0 .. n-2. `propose` writes positions n-1 .. n-2+steps from drafts; all are rewritten by later
    observes before any forward reads them, and a k-pool completed by a draft entry is recompressed
    when its last entry is written again, exactly as the target's own caches roll back.
    """

    def __init__(
        self,
        layer: MTPLayer,
        target: Glm5NextForCausalLM,
        num_steps: int = 1,
        indexer_dtype: torch.dtype | None = None,
    ):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.layer, self.target = layer, target
        self.num_steps = self.num_draft_tokens = num_steps
        self.capture_layers = (target.config.num_hidden_layers - 1,)
        self.indexer_dtype = indexer_dtype
        weight = target.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        # The MTP layer has no KDA state; a forward batch still carries a (here empty) state cache.
        self.states = StateCache(layer.config, 0, self.dtype, self.device)
        self.cache: TokenCache | None = None
        self.table: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        target: Glm5NextForCausalLM,
        num_steps: int = 1,
        indexer_dtype: torch.dtype | None = None,
        random_weights: bool = False,
    ) -> MTPProposer:
        """The MTP layer of the target checkpoint at `path` (with `random_weights`, built from its
        config alone with the seeded random init, as `load_format="dummy"` asks)."""
        layer = load_mtp_layer(path, target, random_weights=random_weights)
        return cls(layer, target, num_steps, indexer_dtype)

    def bytes_per_token(self) -> float:
        return TokenCache.bytes_per_token(self.layer.config, self.dtype, self.indexer_dtype)

    def attach(self, num_token_slots: int, req_to_token: torch.Tensor) -> None:
        super().attach(num_token_slots, req_to_token)
        self.cache = TokenCache(
            self.layer.config, num_token_slots, self.dtype, self.device, self.indexer_dtype
        )
        self.table = req_to_token
        self.last_hidden = torch.zeros(
            req_to_token.shape[0], self.target.config.hidden_size, dtype=self.dtype, device=self.device
        )

    def _batch(self, chunks: Sequence[SequenceChunk]) -> ForwardBatch:
        return ForwardBatch.build(chunks, self.table, self.cache, self.states, self.layer.config.index_kpool)

    @torch.inference_mode()
    def observe(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """One MTP forward writes the entries the committed tokens complete: for tokens at positions
        `start .. start+count-1`, entries `start-1 .. start+count-2` (none for token 0)."""
        assert commit.host is not None, "the MTP proposer observes after the step's read"
        features = batch.features
        kept = [c for c in commit.host if c.count]
        if not kept or features is None:
            return
        rows = torch.tensor([c.request.slot for c in kept])
        offsets = torch.tensor([c.offset for c in kept])
        counts = torch.tensor([c.count for c in kept])
        skip_first = torch.tensor([c.start == 0 for c in kept], dtype=torch.long)
        entries = counts - skip_first
        seq = torch.repeat_interleave(torch.arange(len(kept)), entries)
        within = torch.arange(int(entries.sum())) - (torch.cumsum(entries, 0) - entries)[seq]
        token_index = offsets[seq] + skip_first[seq] + within  # packed row of token i+1
        hidden_index = token_index - 1  # packed row of h_i; before the chunk it is h_{start-1}, kept
        kept_hidden = (hidden_index < offsets[seq])[:, None]

        chunks = [
            SequenceChunk([0] * n, c.start - 1 + first, c.request.slot, c.request.slot, sample=False)
            for c, n, first in zip(kept, entries.tolist(), skip_first.tolist(), strict=True)
            if n
        ]
        if chunks:
            device = features.device
            hidden = torch.where(
                kept_hidden.to(device),
                self.last_hidden[rows[seq].to(device)],
                features[hidden_index.clamp(min=0).to(device)],
            )
            embeds = self.layer.embedding(self.target)(batch.input_ids[token_index.to(device)])
            self.layer(embeds, hidden, self._batch(chunks))
        self.last_hidden[rows.to(self.device)] = features[(offsets + counts - 1).to(features.device)]

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """Step s (from 0) runs every sampling sequence at position n-1+s (n = its committed length):
        step 0 pairs the last committed hidden with the anchor, later steps the previous step's MTP
        hidden with its draft; draft s goes to column s of the request's draft row."""
        assert commit.host is not None, "the MTP proposer drafts after the step's read"
        picked = [c for c in commit.host if c.new_tokens]
        if not picked:
            return
        lengths = [c.start + c.count for c in picked]
        rows = [c.request.slot for c in picked]
        rows_d = torch.tensor(rows, device=self.device)
        tokens = torch.tensor([c.new_tokens[-1] for c in picked], device=self.device)
        hidden = self.last_hidden[rows_d]
        for step in range(self.num_steps):
            chunks = [
                SequenceChunk([0], n - 1 + step, row, row, sample=False)
                for n, row in zip(lengths, rows, strict=True)
            ]
            hidden = self.layer(self.layer.embedding(self.target)(tokens), hidden, self._batch(chunks))
            tokens = self.layer.logits(hidden, self.target).argmax(-1)
            self.drafts[rows_d, step] = tokens
