"""Training DFlash and DFlash2 drafts for a frozen target: new drafts, the objective, and the export.

The recipe is z-lab's (shared/research/dflash.md §3, as SpecForge's `OnlineDFlashModel` ports it): the
target is frozen and its features of every token are given; anchors are drawn at random among the
positions whose next token is a response token; each anchor a gives a block `[token_a, mask × (B−1)]` at
positions a..a+B−1, embedded by the target's `embed_tokens`. All blocks of a sequence run in one pass:
a block row attends to the context (every position's features through `fc`, `hidden_norm` and the
layer's k/v projections) strictly before its anchor, and to every row of its own block, never to
another block; this is exactly what the block sees at serving time, where the context is the committed
tokens and the anchor is the newest token, which has no features yet. Row k = 1..B−1 predicts token
a+k through the target's `lm_head`, with cross-entropy weighted by `exp(−(k−1)/γ)`: an early miss voids
the rest of the block, so early rows matter more.

DFlash2 drafts run the same pass (their `DraftLayer`s apply the block convs), take their logits from
`DFlashDraftModel.logits` (output multiplier and soft cap) and add a selector loss; see
`selector_loss`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hylo.config import ModelConfig
from hylo.layers.linear import unfused_state_dict
from hylo.models.dflash import (
    ARCHITECTURES,
    DFLASH2_ARCHITECTURE,
    CandidateSelector,
    DFlashConfig,
    DFlashDraftModel,
    DraftAttention,
)

DFLASH_ARCHITECTURE = ARCHITECTURES[0]
GAMMA = 7.0  # z-lab's loss decay
NUM_ANCHORS = 512  # z-lab's anchors per sequence
Algorithm = Literal["dflash", "dflash2"]


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The target layers whose outputs a draft reads, as z-lab's `build_target_layer_ids`: the middle
    layer for one feature, else `round(1 + i·(L−4)/(n−1))`, evenly from layer 1 to layer L−3 (clamped
    to the target's layers for targets of fewer than 4 layers)."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 4) / (num_features - 1)
    return [min(max(round(1 + i * span), 0), num_target_layers - 1) for i in range(num_features)]


def new_draft_config(
    target: ModelConfig,
    algorithm: Algorithm,
    *,
    mask_token_id: int,
    block_size: int = 8,
    num_layers: int = 2,
    num_features: int | None = None,
    target_layer_ids: list[int] | None = None,
    head_dim: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    rope_theta: float = 1e6,
    rms_norm_eps: float = 1e-6,
    conv_kernel_size: int = 4,
    conv_group_size: int | None = None,
    selector_rank: int = 32,
    selector_top_k: int = 8,
) -> dict:
    """The z-lab `config.json` of a new draft for `target`, checked by `DFlashConfig.from_dict`.

    Defaults follow z-lab's released drafts (Qwen3-8B's: head_dim 128, 32 heads, 8 KV heads, MLP 3×
    hidden): head_dim `min(128, hidden/4)`, heads `hidden/head_dim`, a quarter as many KV heads (a
    divisor of the heads), MLP `3·hidden`, one target feature per draft layer (`num_features`), every
    layer full attention. DFlash2: `conv_group_size` defaults to the largest divisor of hidden ≤ 16.
    `target_layer_ids` overrides z-lab's spread (`build_target_layer_ids`): a shallow target's spread
    never reaches its last layers, which carry the most about the next tokens.
    """
    if algorithm not in ("dflash", "dflash2"):
        raise ValueError(f"algorithm must be 'dflash' or 'dflash2', got {algorithm!r}")
    hidden = target.hidden_size
    if not 0 <= mask_token_id < target.vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the target vocabulary {target.vocab_size}"
        )
    head_dim = head_dim or min(128, hidden // 4)
    heads = num_attention_heads or hidden // head_dim
    kv_heads = num_key_value_heads or math.gcd(heads, max(1, heads // 4))
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    types = layer_types or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"{len(types)} layer_types for {num_layers} layers")
    if "sliding_attention" in types and not sliding_window:
        raise ValueError("sliding_attention layers need a sliding_window")
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(target.num_hidden_layers, num_features or num_layers)
    elif not target_layer_ids or any(not 0 <= i < target.num_hidden_layers for i in target_layer_ids):
        raise ValueError(
            f"target_layer_ids {target_layer_ids}: each must be a layer of the target "
            f"(0..{target.num_hidden_layers - 1})"
        )
    options: dict = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    if algorithm == "dflash2":
        group = conv_group_size or max(g for g in range(1, 17) if hidden % g == 0)
        options |= {
            "conv_kernel_size": conv_kernel_size,
            "conv_group_size": group,
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        }
    config = {
        "architectures": [DFLASH2_ARCHITECTURE if algorithm == "dflash2" else DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or 3 * hidden,
        "rms_norm_eps": rms_norm_eps,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "layer_types": types,
        "sliding_window": sliding_window,
        "is_causal": False,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": options,
    }
    DFlashConfig.from_dict(config)  # the same checks as loading it
    return config


def init_draft(config: dict, seed: int, std: float = 0.02) -> DFlashDraftModel:
    """A new fp32 draft with deterministic trainable weights (drawn from `seed` in name order): norms
    at 1, projections and selector codebooks normal(0, `std`) as HF's `initializer_range`; DFlash2's
    convs start near the identity (base kernel 1 at tap 0, 0 elsewhere; kernel projections scaled so
    that a normed row's tap deltas have std `std`). Drawn per checkpoint tensor (a fused projection's
    parts one by one), so a seed gives the same draft however the projections are fused."""
    draft = DFlashDraftModel(DFlashConfig.from_dict(config))
    gen = torch.Generator().manual_seed(seed)
    hidden = draft.config.hidden_size
    with torch.no_grad():  # the state dict's tensors share the parameters' storage
        for name, p in sorted(unfused_state_dict(draft).items()):
            if name.endswith("norm.weight"):
                p.fill_(1)
            elif name.endswith("base_kernel"):
                p.zero_()[:, 0] = 1
            elif name.endswith("kernel_projection.weight"):
                p.normal_(0, std * hidden**-0.5, generator=gen)
            else:
                p.normal_(0, std, generator=gen)
    return draft


def save_draft(
    draft: DFlashDraftModel, config: dict, directory: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write `config.json` and `model.safetensors` (the z-lab tensor names, `unfused_state_dict`'s, as
    `load_flat` reads them; in `dtype`, default the draft's) to `directory`. `config` must describe
    `draft`."""
    if DFlashConfig.from_dict(config) != draft.config:
        raise ValueError("config does not describe this draft")
    dtype = dtype or next(draft.parameters()).dtype
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # copies: a fused projection's parts are rows of one tensor, and safetensors refuses shared storage
    tensors = {name: t.to("cpu", dtype, copy=True) for name, t in unfused_state_dict(draft).items()}
    written = config | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def block_targets(
    tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What rows 1..B−1 of each block predict: `targets [S, N, B−1]` = token a+k, and `valid` where the
    block is kept, a+k < L and `loss_mask[a+k]` (rows running past the sequence or the response
    train on nothing)."""
    length = tokens.shape[1]
    where = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    flat = where.clamp(max=length - 1).flatten(1)
    targets = tokens.gather(1, flat).view_as(where)
    valid = keep[..., None] & (where < length) & loss_mask.gather(1, flat).view_as(where)
    return targets, valid


def block_attention_mask(
    anchors: torch.Tensor, length: int, block_size: int, window: int | None
) -> torch.Tensor:
    """`[S, N·B, L + N·B]` bool: row k of block n (anchor a) may read context key j iff j < a, and the
    block keys of its own block only; with a `window`, only keys at positions > its position − window
    (`DraftAttention`'s rule). A row always reads itself, so no row is fully masked."""
    device = anchors.device
    blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=device)
    query_pos = (anchors[..., None] + offsets).flatten(1)
    context = torch.arange(length, device=device) < anchors.repeat_interleave(block_size, 1)[..., None]
    block_id = torch.arange(blocks, device=device).repeat_interleave(block_size)
    own = (block_id[:, None] == block_id[None, :]).expand(anchors.shape[0], -1, -1)
    allowed = torch.cat([context, own], -1)
    if window is not None:
        key_pos = torch.cat([torch.arange(length, device=device).expand(anchors.shape[0], -1), query_pos], 1)
        allowed = allowed & (key_pos[:, None, :] > query_pos[..., None] - window)
    return allowed


def _shared_context_attention(
    attn: DraftAttention, h: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
    context_pos: torch.Tensor, allowed: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`attn` for the blocks `h [S·N, B, H]` at `positions [S·N, B]`, the N blocks of each sequence in
    one attention over its context `[S, L, H]` and all its blocks' keys, separated by `allowed`."""
    c = attn.c
    seqs = context.shape[0]
    q, k_blk, v_blk = (t.flatten(0, 1).unflatten(0, (seqs, -1)) for t in attn.project(h, positions))
    k_ctx, v_ctx = attn.key_value(context, context_pos)
    group = c.num_attention_heads // c.num_key_value_heads
    keys, values = (
        torch.cat(pair, 1).repeat_interleave(group, 2) for pair in ((k_ctx, k_blk), (v_ctx, v_blk))
    )
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=allowed[:, None],
        scale=c.head_dim**-0.5,
    )  # fmt: skip
    return attn.o_proj(out.transpose(1, 2).flatten(-2).flatten(0, 1).unflatten(0, h.shape[:2]))


def _pairwise(
    selector: CandidateSelector, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor
) -> torch.Tensor:
    """The selector's fp32 pairwise score `[..., C]` of `candidates [..., C]` after `predecessors [...]`
    for rows `hidden [..., H]`, as `CandidateSelector.forward` scores them."""
    return torch.einsum(
        "...r,...r,...cr->...c", selector.predecessor_codebook[predecessors].float(),
        selector.hidden_projection(hidden).float(), selector.successor_codebook[candidates].float(),
    )  # fmt: skip


def selector_loss(
    selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Per-row selector cross-entropy `[...]`, teacher-forced: for drafted rows `hidden [..., H]` with
    fp32 `logits [..., V]`, the candidates are the row's `top_k` tokens plus the true token when it is
    not among them (so every row has a label), scored as at inference, `logit(c) + pairwise(p, c, h)`,
    after the true previous token `predecessors [...]` (the anchor for row 1).

    The logits enter detached: the draft's own CE trains them, and the selector learns the
    predecessor-dependent correction on top of them (its gradient still reaches the draft's hidden
    states through `hidden_projection`, so the trunk can learn to feed it). The true token added
    outside the top-k is what inference could never pick; it keeps the loss defined and pushes the
    selector to keep it from being outscored, but only the draft CE can bring it into the top-k."""
    unary = logits.detach()
    top = unary.topk(selector.top_k, dim=-1).indices
    hit = top == targets[..., None]
    found = hit.any(-1)
    candidates = torch.cat([top, targets[..., None]], -1)
    scores = unary.gather(-1, candidates) + _pairwise(selector, hidden, predecessors, candidates)
    duplicate = torch.cat([torch.zeros_like(hit), found[..., None]], -1)
    scores = scores.masked_fill(duplicate, float("-inf"))
    label = torch.where(found, hit.int().argmax(-1), selector.top_k)
    return F.cross_entropy(scores.flatten(0, -2), label.flatten(), reduction="none").view_as(targets)


@dataclass(frozen=True)
class FrozenTarget:
    """The target modules the draft borrows; held outside the objective's module tree, so they are not
    trained, moved, or saved with it."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class DFlashObjective(nn.Module):
    """The DFlash / DFlash2 training loss of `draft` for a frozen target (its `embed_tokens` and
    `lm_head`, whose parameters are switched to `requires_grad=False` here). `parameters()` are the
    draft's only."""

    def __init__(
        self, draft: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module,
        num_anchors: int = NUM_ANCHORS, gamma: float = GAMMA,
    ):  # fmt: skip
        super().__init__()
        self.draft, self.num_anchors, self.gamma = draft, num_anchors, gamma
        for p in (*embed_tokens.parameters(), *lm_head.parameters()):
            p.requires_grad_(False)
        self.target = FrozenTarget(embed_tokens, lm_head)

    def sample_anchors(
        self, loss_mask: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`anchors [S, N]` and `keep [S, N]` for bool `loss_mask [S, L]`: up to `num_anchors` distinct
        positions a per sequence with `loss_mask[a+1]`, uniformly without replacement (`generator` on
        the mask's device); N is the most any sequence got, and the `~keep` padding anchors are 0.
        Raises if no sequence has one."""
        if loss_mask.dtype != torch.bool:
            raise TypeError(f"loss_mask must be bool, got {loss_mask.dtype}")
        eligible = torch.zeros_like(loss_mask)
        eligible[:, :-1] = loss_mask[:, 1:]
        counts = eligible.sum(1)
        n = min(self.num_anchors, int(counts.max()))
        if n == 0:
            raise ValueError("no position is followed by a response token (loss_mask): nothing to train on")
        keys = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
        order = keys.masked_fill(~eligible, 2.0).argsort(1)[:, :n]  # eligible positions first, shuffled
        keep = torch.arange(n, device=loss_mask.device) < counts[:, None]
        return torch.where(keep, order, 0), keep

    def hidden(self, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The draft's final hidden states `[S, N, B, H]` of the blocks at `anchors [S, N]` of sequences
        `tokens [S, L]` with target features `features [S, L, K·H]`: identical to
        `DFlashDraftModel.forward` of each block over the features of the positions before its anchor."""
        draft, c = self.draft, self.draft.config
        seqs, length = tokens.shape
        dtype = draft.fc.weight.dtype
        positions = (anchors[..., None] + torch.arange(c.block_size, device=tokens.device)).flatten(0, 1)
        ids = torch.full(positions.shape, c.mask_token_id, device=tokens.device)
        ids[:, 0] = tokens.gather(1, anchors).flatten()
        block = self.target.embed_tokens(ids).to(dtype)
        context = draft.hidden_norm(draft.fc(features.to(dtype)))
        context_pos = torch.arange(length, device=tokens.device).expand(seqs, -1)
        windows = {layer.self_attn.window for layer in draft.layers}
        masks = {w: block_attention_mask(anchors, length, c.block_size, w) for w in windows}

        def attend(i: int, h: torch.Tensor) -> torch.Tensor:
            attn = draft.layers[i].self_attn
            return _shared_context_attention(attn, h, positions, context, context_pos, masks[attn.window])

        return draft.stack(block, attend).unflatten(0, anchors.shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 proposal logits of drafted rows: the target head's (DFlash2: scaled and soft-capped)."""
        head = self.target.lm_head
        hidden = hidden.to(head.weight.dtype)
        if self.draft.config.dflash2 is None:
            return head(hidden).float()
        return self.draft.logits(hidden, head)

    def position_weights(self, device: torch.device) -> torch.Tensor:
        """`[B−1]`: row k weighs `exp(−(k−1)/γ)`."""
        k = torch.arange(1, self.draft.config.block_size, device=device)
        return torch.exp(-(k - 1) / self.gamma)

    def loss(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        loss_mask: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of sequences `tokens [S, L]` (long) with target features `features [S, L, K·H]` and
        response positions `loss_mask [S, L]` (bool): the weighted draft CE over the valid targets of
        freshly sampled blocks, normalised by their weights, plus (DFlash2) the selector CE, weighted
        and normalised the same way.

        `tokens`, `features`, `loss_mask` and `generator` share the draft's device. Rows whose
        targets are invalid (past the sequence or outside the response) are still computed and
        weigh 0. The logits are fp32 `[S, N, B−1, V]`: `num_anchors` bounds the memory.

        Stats (detached tensors): `loss_draft`, `loss_selector` (DFlash2), `accuracy [B−1]` (the
        proposals the draft would make at serving time, the selector's path for DFlash2, against the
        true tokens, per row over valid targets), `accepted` (mean leading correct proposals per block)
        and `targets` (count)."""
        anchors, keep = self.sample_anchors(loss_mask, generator)
        targets, valid = block_targets(tokens, loss_mask, anchors, keep, self.draft.config.block_size)
        rows = self.hidden(tokens, features, anchors)[:, :, 1:]
        logits = self.logits(rows)
        weights = valid * self.position_weights(tokens.device)
        total = weights.sum()
        ce = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view_as(targets)
        loss = (ce * weights).sum() / total
        stats = {"loss_draft": loss.detach()}
        anchor_tokens = tokens.gather(1, anchors)
        selector = getattr(self.draft, "candidate_selector", None)
        if selector is not None:
            predecessors = torch.cat([anchor_tokens[..., None], targets[..., :-1]], -1)
            sel = (selector_loss(selector, rows, logits, predecessors, targets) * weights).sum() / total
            stats["loss_selector"] = sel.detach()
            loss = loss + sel
        with torch.no_grad():
            proposals = self.proposals(rows, logits, anchor_tokens)
        return loss, stats | _accuracy(proposals, targets, valid, keep)

    def proposals(
        self, rows: torch.Tensor, logits: torch.Tensor, anchor_tokens: torch.Tensor
    ) -> torch.Tensor:
        """`[S, N, B−1]`: what `DFlashDraftModel.propose` drafts from these rows and logits."""
        if self.draft.config.dflash2 is None:
            return logits.argmax(-1)
        path = self.draft.candidate_selector(
            rows.flatten(0, 1), logits.flatten(0, 1), anchor_tokens.flatten()
        )
        return path.view(logits.shape[:-1])


def _accuracy(
    proposals: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-row accuracy `[B−1]` over valid targets, mean leading correct proposals over kept blocks
    (a block's serving-time accepted drafts when the data are the target's own greedy tokens), and the
    number of valid targets."""
    correct = (proposals == targets) & valid
    return {
        "accuracy": correct.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1),
        "accepted": correct.int().cumprod(-1).sum(-1)[keep].float().mean(),
        "targets": valid.sum(),
    }
