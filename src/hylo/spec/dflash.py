"""DFlash proposer: keeps the draft's context K/V for every committed token and drafts one block
per verify step (DFlash2 drafts pick the block's tokens with their candidate selector)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hylo.engine.request import Request
from hylo.forward_batch import ForwardBatch
from hylo.models.dflash import DFlashConfig, DFlashDraftModel
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import load_flat
from hylo.spec.proposer import Committed, Proposer


class DFlashProposer(Proposer):
    """Draft K/V live in `[layer, token slot, kv heads, head dim]` pools indexed by the target's
    request table, so a request's draft context is exactly its committed positions."""

    def __init__(self, draft: DFlashDraftModel, target: Glm5NextForCausalLM, block_size: int | None = None):
        c = draft.config
        self.draft, self.target = draft, target
        self.block_size = block_size or c.block_size
        self.num_draft_tokens = self.block_size - 1
        self.capture_layers = c.target_layer_ids
        self.k_cache = self.v_cache = self.table = None

    @classmethod
    def load(
        cls, path: str | Path, target: Glm5NextForCausalLM, block_size: int | None = None
    ) -> DFlashProposer:
        c = DFlashConfig.from_dir(path)
        t = target.config
        if c.hidden_size != t.hidden_size:
            raise ValueError(
                f"{path}: draft hidden_size {c.hidden_size} != target hidden_size {t.hidden_size}"
            )
        if not 0 <= c.mask_token_id < t.vocab_size:
            raise ValueError(f"{path}: mask_token_id {c.mask_token_id} is outside the target vocabulary")
        if any(not 0 <= i < t.num_hidden_layers for i in c.target_layer_ids):
            raise ValueError(
                f"{path}: target_layer_ids {list(c.target_layer_ids)} exceed the target's layers"
            )
        if c.dflash2 is not None and c.dflash2.vocab_size != t.vocab_size:
            raise ValueError(
                f"{path}: DFlash2 vocab_size {c.dflash2.vocab_size} != target vocab_size {t.vocab_size} "
                "(the selector's codebooks are indexed by the target's token ids)"
            )
        weight = target.embed_tokens.weight
        with torch.device("meta"):
            draft = DFlashDraftModel(c)
        draft = draft.to_empty(device=weight.device).to(weight.dtype)
        load_flat(draft, path)
        return cls(draft.eval(), target, block_size)

    def bytes_per_token(self) -> float:
        c = self.draft.config
        elem = self.target.embed_tokens.weight.element_size()
        return 2.0 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem

    def attach(self, num_token_slots: int, req_to_token: torch.Tensor) -> None:
        c = self.draft.config
        w = self.target.embed_tokens.weight
        shape = (c.num_hidden_layers, num_token_slots, c.num_key_value_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.v_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.table = req_to_token

    @torch.inference_mode()
    def observe(
        self, batch: ForwardBatch, features: torch.Tensor | None, committed: Sequence[Committed]
    ) -> None:
        kept = [c for c in committed if c.count]
        if not kept or features is None:
            return
        device = features.device
        rows = torch.tensor([c.offset + t for c in kept for t in range(c.count)], device=device)
        positions = torch.tensor([c.start + t for c in kept for t in range(c.count)], device=device)
        table_rows = torch.tensor([c.request.slot for c in kept for _ in range(c.count)], device=device)
        slots = self.table[table_rows, positions].long()
        for layer, (k, v) in enumerate(self.draft.context_kv(features[rows], positions)):
            self.k_cache[layer, slots], self.v_cache[layer, slots] = k, v

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        c = self.draft.config
        device = self.k_cache.device
        anchors = [r.tokens(r.num_computed, r.num_computed + 1)[0] for r in requests]
        lengths = torch.tensor([r.num_computed for r in requests], device=device)
        block = torch.full((len(requests), self.block_size), c.mask_token_id, device=device)
        block[:, 0] = torch.tensor(anchors, device=device)
        positions = lengths[:, None] + torch.arange(self.block_size, device=device)
        longest = max(r.num_computed for r in requests)
        ctx_pos = torch.arange(longest, device=device).expand(len(requests), -1)
        ctx_valid = ctx_pos < lengths[:, None]
        rows = torch.tensor([r.slot for r in requests], device=device)
        slots = self.table[rows[:, None], ctx_pos].long()
        ctx_kv = [(self.k_cache[i][slots], self.v_cache[i][slots]) for i in range(c.num_hidden_layers)]
        hidden = self.draft(self.target.embed_tokens(block), positions, ctx_kv, ctx_pos, ctx_valid)
        drafts = self.draft.propose(hidden[:, 1:], block[:, 0], self.target.lm_head).tolist()
        return [d[:b] for d, b in zip(drafts, budgets, strict=True)]
