"""DFlash proposer: keeps the draft's context K/V for every committed token and drafts one block
per verify step (DFlash2 drafts pick the block's tokens with their candidate selector)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hylo.forward_batch import ForwardBatch
from hylo.layers.vocab import HotTokenHead, VocabHead
from hylo.memory.specs import CacheSpec, Unit
from hylo.models.dflash import DFlashConfig, DFlashDraftModel, PagedContext
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import load_flat
from hylo.ops.dflash_inputs import CommittedTokens, committed_slots, draft_blocks
from hylo.ops.draft_attention import ContextTokens, KeyTransform, KVCache, store_context_kv
from hylo.ops.gemm import linear
from hylo.speculative.proposer import Proposer, ProposerBuild, ProposerCaches, StepCommit
from hylo.speculative.verify import VerifyShape


@dataclass
class DraftKV:
    """The draft's context K and V of every token slot: `[layer, token slot, kv heads, head dim]`."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class DraftKVSpec(CacheSpec):
    """A DFlash draft's context K/V per token-cache slot, every draft layer."""

    config: DFlashConfig
    dtype: torch.dtype
    name: str = "draft_kv"
    unit = Unit.TOKEN

    def bytes_per_unit(self) -> float:
        c = self.config
        return 2.0 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def allocate(self, count: int, device: torch.device | str) -> DraftKV:
        c = self.config
        shape = (c.num_hidden_layers, count, c.num_key_value_heads, c.head_dim)
        return DraftKV(*(torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2)))


class DFlashProposer(Proposer):
    """Draft K/V live in `[layer, token slot, kv heads, head dim]` pools indexed by the target's
    request table (`caches.pools[0]`, a `DraftKV` from `DraftKVSpec`), so a request's draft context is
    exactly its committed positions."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        target: Glm5NextForCausalLM,
        caches: ProposerCaches,
        block_size: int | None = None,
        head: VocabHead | HotTokenHead | None = None,
    ):
        """`head`: what drafts are picked with (default the target's `lm_head`; a token map's
        `HotTokenHead`)."""
        c = draft.config
        self.draft, self.target = draft, target
        self.head = target.lm_head if head is None else head
        self.verify_shape = VerifyShape(block_size or c.block_size)
        self.capture_layers = c.target_layer_ids
        self.needs_host = False
        self.observes_padded = True  # observe writes `counts` tokens per sequence; propose reads lengths
        (kv,) = caches.pools
        self.k_cache, self.v_cache = kv.k, kv.v
        self.table, self.drafts = caches.req_to_token, caches.drafts
        w = target.embed_tokens.weight
        self.draft.build_rotary(self.table.shape[1] + self.verify_shape.block, w.device)
        # every layer's k and v projections (the last rows of its fused q|k|v weight) stacked into one
        # weight, so that a step's new context K/V is one GEMM and one store launch
        attns = [layer.self_attn for layer in self.draft.layers]
        self.kv_weight = torch.cat([a.kv_weight for a in attns])
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])

    @classmethod
    def load(
        cls,
        path: str | Path,
        target: Glm5NextForCausalLM,
        block_size: int | None = None,
        token_map: torch.Tensor | None = None,
    ) -> ProposerBuild:
        """The draft at `path`, checked against the target and loaded in its dtype on its device; the
        proposer is built around the draft K/V pool the memory plan allocates."""
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
        if c.dflash2 is not None and token_map is not None and token_map.numel() < c.dflash2.selector_top_k:
            raise ValueError(
                f"speculative_token_map: {token_map.numel()} tokens, fewer than the DFlash2 draft's "
                f"selector_top_k ({c.dflash2.selector_top_k}) candidates per row"
            )
        weight = target.embed_tokens.weight
        with torch.device("meta"):
            draft = DFlashDraftModel(c)
        draft = draft.to_empty(device=weight.device).to(weight.dtype)
        load_flat(draft, path)
        draft = draft.eval()
        shape = VerifyShape(block_size or c.block_size)
        # made before the memory plan, which then counts its copy of the map's head rows
        head = None if token_map is None else target.lm_head.restricted(token_map)
        build = lambda caches: cls(draft, target, caches, shape.block, head)  # noqa: E731
        return ProposerBuild([DraftKVSpec(c, weight.dtype)], shape, build)

    def copy_tokens(self, src: int, dst: int, n: int) -> None:
        for cache in (self.k_cache, self.v_cache):
            cache[:, dst : dst + n] = cache[:, src : src + n]

    @torch.inference_mode()
    def observe(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """Draft K/V of every committed token of the forward, from its captured target features, in
        one store launch for all layers (the other tokens' slots are -1: not written)."""
        if commit.features is None:
            return
        c = self.draft.config
        slots = committed_slots(_committed(batch, commit))
        ctx = self.draft.hidden_norm(self.draft.fc(commit.features))
        kv = linear(ctx, self.kv_weight).view(-1, c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim)
        kv = kv.permute(2, 1, 0, 3, 4)  # [k|v, layer, token, kv heads, d]
        rotary = self.draft.layers[0].self_attn.rotary
        store_context_kv(
            ContextTokens(kv[0], kv[1], batch.positions, slots),
            KeyTransform(self.k_norm_weight, c.rms_norm_eps, rotary.cos, rotary.sin),
            KVCache(self.k_cache, self.v_cache),
        )

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch, commit: StepCommit) -> None:
        """One block per sampling sequence, [anchor, mask × (B−1)] right after its committed tokens,
        attending its context through the request table; the drafts go to `drafts[row]`."""
        c = self.draft.config
        # a request's table row and state slot share the index
        rows, lengths, block, positions = draft_blocks(
            _committed(batch, commit), batch.state_slots, commit.sampling, commit.anchors,
            self.verify_shape.block, c.mask_token_id,
        )  # fmt: skip
        context = PagedContext(self.k_cache, self.v_cache, self.table, rows, lengths)
        hidden = self.draft.forward_paged(self.target.embed_tokens(block), positions, context)
        self.drafts[rows] = self.draft.propose(hidden[:, 1:], block[:, 0], self.head)


def _committed(batch: ForwardBatch, commit: StepCommit) -> CommittedTokens:
    """The forward's packed tokens and what it committed, as `ops.dflash_inputs` reads them."""
    return CommittedTokens(batch.token_seq, batch.pad_index, batch.positions, batch.new_slots, commit.counts)
