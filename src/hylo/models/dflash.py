"""DFlash and DFlash2 block-diffusion draft models (z-lab checkpoint format).

A stack of Qwen3-style layers with no embedding or head of its own: the block `[anchor, mask × (B−1)]`
is embedded with the target's embeddings, every layer attends (non-causally inside the block) to
the block and to the context, and the context is the committed tokens' target features after
`target_layer_ids`, fused by `fc` + `hidden_norm` and projected by each layer's k/v projections
(k_norm and RoPE at the token's absolute position). Proposals come from the target's `lm_head`.

DFlash2 (`architectures: ["DFlash2DraftModel"]`) adds two things, with the semantics of z-lab's own
reference (github.com/z-lab/dflash, `dflash/model.py`: `GroupedDynamicCausalConv`,
`CandidateSelector`, `DFlashDraftModel.compute_logits`, `dflash_generate`):

- Each sublayer (attention, MLP) is wrapped by a grouped dynamic causal conv over the block rows.
  Its kernel is `base_kernel[side, tap, channel] + delta[row, side, tap, group]`, where
  `delta = kernel_projection(h)` is computed from each row's *normed* sublayer input `h` and laid
  out `[side, tap, group]`; group g covers channels `g·group_size .. (g+1)·group_size − 1`. Side 0
  convolves `h` before the sublayer, side 1 convolves the sublayer's output (with the same row's
  deltas) before the residual add. Tap t reads row i − t of the same block; rows before the block
  start read zeros, and the context (target features) is never convolved.
- Proposals: the head's logits are scaled by `output_multiplier`, then soft-capped
  (`cap · tanh(logits / cap)`) when `final_logit_softcapping` is set and positive. The
  `selector_top_k` best tokens per drafted row are candidates (serving takes them from the head's
  own output, both transforms being increasing: `DFlashDraftModel.top_candidates`); the path is
  chosen greedily from the first drafted row on, scoring candidate c after predecessor p as
  `logit(c) + Σ_r pred_codebook[p, r] · hidden_projection(h_row)[r] · succ_codebook[c, r]`, where
  the first predecessor is the anchor token and `h_row` is the draft's final (normed) hidden state.

Both formats honour `dflash_config.input_embedding_scale` (default 1), which z-lab multiplies into
the block's embeddings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from hylo.layers.linear import FusedLinear, Linear
from hylo.layers.norm import RMSNorm
from hylo.layers.vocab import VocabHead
from hylo.ops import topk as topk_ops
from hylo.ops.activation import swiglu_clamp
from hylo.ops.block_conv import grouped_block_conv
from hylo.ops.draft_attention import (
    ContextTable,
    DraftBlock,
    KVCache,
    normed_rotated,
    paged_draft_attention,
    rotary_tables,
)
from hylo.ops.draft_attention.reference import inverse_frequencies
from hylo.ops.gemm import linear

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = ("DFlashDraftModel", DFLASH2_ARCHITECTURE)
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class DFlash2Config:
    """The DFlash2 additions: grouped conv (`conv_*`) and candidate selector (`selector_*`, logits)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    vocab_size: int
    output_multiplier: float
    final_logit_softcapping: float | None

    @classmethod
    def parse(cls, raw: dict, file: Path, block_size: int) -> DFlash2Config:
        options = raw.get("dflash_config") or {}
        missing = [k for k in DFLASH2_REQUIRED if k not in options]
        if "vocab_size" not in raw:
            missing.append("vocab_size (top level)")
        if missing:
            raise ValueError(f"{file}: a DFlash2 draft's config lacks {', '.join(missing)}")
        for key in DFLASH2_REQUIRED:
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{file}: dflash_config.{key} must be a positive integer, got {value!r}")
        hidden, vocab = raw["hidden_size"], raw["vocab_size"]
        if hidden % options["conv_group_size"]:
            raise ValueError(
                f"{file}: dflash_config.conv_group_size {options['conv_group_size']} does not divide "
                f"hidden_size {hidden}"
            )
        if options["conv_kernel_size"] > block_size:
            raise ValueError(
                f"{file}: dflash_config.conv_kernel_size {options['conv_kernel_size']} exceeds "
                f"block_size {block_size}"
            )
        if options["selector_top_k"] > vocab:
            raise ValueError(
                f"{file}: dflash_config.selector_top_k {options['selector_top_k']} exceeds vocab_size {vocab}"
            )
        multiplier = options.get("output_multiplier", 1.0)
        if not _is_finite_number(multiplier) or multiplier <= 0:
            raise ValueError(f"{file}: dflash_config.output_multiplier must be positive, got {multiplier!r}")
        cap = options.get("final_logit_softcapping")
        if cap is not None and (not _is_finite_number(cap) or cap < 0):
            raise ValueError(f"{file}: dflash_config.final_logit_softcapping must be >= 0, got {cap!r}")
        return cls(
            conv_kernel_size=options["conv_kernel_size"], conv_group_size=options["conv_group_size"],
            selector_rank=options["selector_rank"], selector_top_k=options["selector_top_k"],
            vocab_size=vocab, output_multiplier=float(multiplier),
            final_logit_softcapping=float(cap) if cap else None,
        )  # fmt: skip


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    input_embedding_scale: float = 1.0
    dflash2: DFlash2Config | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a DFlash draft directory needs a config.json")
        return cls.from_dict(json.loads(file.read_text()), file)

    @classmethod
    def from_dict(cls, raw: dict, file: Path = Path("config.json")) -> DFlashConfig:
        """The config of a parsed z-lab `config.json` (`file` names it in errors)."""
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{file}: architecture {arch!r} is not a supported DFlash draft {ARCHITECTURES}")
        dflash = raw.get("dflash_config") or {}
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise ValueError(f"{file}: dflash_config lacks {', '.join(missing)}")
        n = raw["num_hidden_layers"]
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        dflash2 = (
            DFlash2Config.parse(raw, file, dflash["block_size"]) if arch == DFLASH2_ARCHITECTURE else None
        )
        return cls(
            hidden_size=raw["hidden_size"], num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
            block_size=dflash["block_size"], mask_token_id=dflash["mask_token_id"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            layer_types=tuple(raw.get("layer_types") or ["full_attention"] * n),
            sliding_window=raw.get("sliding_window"),
            input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)), dflash2=dflash2,
        )  # fmt: skip


def rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float, table: RotaryTable | None = None
) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of `x [..., heads, d]` at `positions [...]`, from `table`
    when given (built once) or from the frequencies."""
    d = x.shape[-1]
    if table is not None:
        cos, sin = table.cos[positions], table.sin[positions]
    else:
        angles = positions.float()[..., None] * inverse_frequencies(d, theta, x.device)
        cos, sin = angles.cos(), angles.sin()
    cos, sin = (torch.cat([f, f], -1)[..., None, :] for f in (cos, sin))
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass(frozen=True)
class RotaryTable:
    """cos and sin of every position's angles, `[positions, d/2]` fp32, computed once."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, positions: int, d: int, theta: float, device) -> RotaryTable:
        return cls(*rotary_tables(positions, d, theta, device))


@dataclass(frozen=True)
class PagedContext:
    """Where R blocks find their committed context: per-layer pools `k_cache`/`v_cache`
    `[layers, token slots, kv heads, d]` indexed through `req_to_token[rows[r], position]`, the first
    `lengths[r]` positions (device) of each request."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor


class DraftAttention(nn.Module):
    """q, k and v read the same input: one GEMM for a block (`qkv_proj`, a `FusedLinear` whose parts keep
    the checkpoint names `q_proj`, `k_proj`, `v_proj`, in that order, so k and v are its last rows,
    `kv_weight`); the context's keys and values are one GEMM over those rows (`key_value`). Every
    projection goes through `ops.gemm.linear` (the tuned dispatch under CUDA-graph capture); the draft
    is never FP8."""

    def __init__(self, c: DFlashConfig, sliding: bool):
        super().__init__()
        self.c, self.window = c, c.sliding_window if sliding else None
        self.rotary: RotaryTable | None = None
        q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.qkv_proj = FusedLinear(
            c.hidden_size, [("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)]
        )
        self.o_proj = Linear(q_width, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    @property
    def kv_weight(self) -> torch.Tensor:
        """k_proj's rows then v_proj's, `[2 · kv heads · d, H]`: a view of `qkv_proj.weight`."""
        return self.qkv_proj.weight[self.c.num_attention_heads * self.c.head_dim :]

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries `[..., heads, d]` and keys `[..., kv heads, d]` (normed, rotated) and values of the
        block `x [..., H]` at `positions [...]`, from one GEMM (the values are a view of its product)."""
        q, k, v = (t.unflatten(-1, (-1, self.c.head_dim)) for t in self.qkv_proj(x))
        q = self._normed_rotated(q, self.q_norm, positions)
        return q, self._normed_rotated(k, self.k_norm, positions), v

    def key_value(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of the context `x [..., H]` at `positions [...]`, from one
        GEMM over `kv_weight` (the values are a view of its product)."""
        k, v = linear(x, self.kv_weight).unflatten(-1, (2, -1, self.c.head_dim)).unbind(-3)
        return self._normed_rotated(k, self.k_norm, positions), v

    def _normed_rotated(self, x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor) -> torch.Tensor:
        """`rope(norm(x))` of `x [..., heads, d]`: with the rotary table built, one op over the flattened
        tokens (one launch on the GPU instead of the norm and ~12 small kernels of `rope`), where
        `positions` has x's token shape and no gradient is recorded (training builds no table)."""
        table = self.rotary
        recorded = torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad)
        if table is None or recorded or positions.shape != x.shape[:-2]:
            return rope(norm(x), positions, self.c.rope_theta, table)
        out = normed_rotated(
            x.flatten(0, -3), norm.weight, norm.eps, table.cos, table.sin, positions.flatten()
        )
        return out.view(x.shape)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
        ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Block `x [R, B, H]` at `positions [R, B]` over context keys `[R, L, kv, d]` (valid where
        `ctx_valid`) and the block's own keys, non-causally."""
        c = self.c
        q, k_blk, v_blk = self.project(x, positions)
        keys, values = torch.cat([ctx_k, k_blk], 1), torch.cat([ctx_v, v_blk], 1)
        key_pos = torch.cat([ctx_pos, positions], 1)
        allowed = torch.cat([ctx_valid, torch.ones_like(positions, dtype=torch.bool)], 1)[:, None, :]
        if self.window is not None:
            allowed = allowed & (key_pos[:, None, :] > positions[:, :, None] - self.window)
        group = c.num_attention_heads // c.num_key_value_heads
        keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
        scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), keys.float()) * c.head_dim**-0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("rhqk,rkhd->rqhd", scores.softmax(-1), values.float()).to(x.dtype)
        return self.o_proj(out.flatten(-2))

    def paged(
        self, x: torch.Tensor, positions: torch.Tensor, context: PagedContext, layer: int
    ) -> torch.Tensor:
        """The same attention with the context read through the request table (`context`, this
        layer's pools at index `layer`) instead of gathered keys."""
        c = self.c
        q, k_blk, v_blk = self.project(x, positions)
        out = paged_draft_attention(
            DraftBlock(q, k_blk, v_blk), KVCache(context.k_cache[layer], context.v_cache[layer]),
            ContextTable(context.req_to_token, context.rows, context.lengths), c.head_dim**-0.5, self.window,
        )  # fmt: skip
        return self.o_proj(out.flatten(-2))


class DraftMLP(nn.Module):
    """SwiGLU whose gate and up are one GEMM (`gate_up_proj`, a `FusedLinear` whose parts keep the
    checkpoint names `gate_proj` and `up_proj`). The activation is `ops.activation.swiglu_clamp` with no
    limit: Qwen3's SiLU(gate) · up with its two roundings, one launch on the GPU instead of two."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_up_proj = FusedLinear(
            c.hidden_size, [("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)]
        )
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(swiglu_clamp(gate, up, math.inf))


class GroupedBlockConv(nn.Module):
    """DFlash2's grouped dynamic causal conv around one sublayer, over the rows of each block."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * taps * (hidden_size // group_size))

    def convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """Rows `x [R, B, H]` (one block per leading index) with per-row group deltas `[R, B, taps, G]`
        (`ops.block_conv.grouped_block_conv`: one launch on the GPU when no gradient is recorded,
        else five differentiable tensor ops). Safe for any B >= 1: when B < taps, the taps that reach
        past the block start read only zeros."""
        return grouped_block_conv(x, self.base_kernel[side], deltas, self.group_size)

    def forward(self, h: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`sublayer` applied between the input-side and the output-side conv of the normed input `h`."""
        deltas = self.kernel_projection(h).unflatten(-1, (2, self.taps, -1))
        inner = sublayer(self.convolve(h, deltas[..., 0, :, :], side=0))
        return self.convolve(inner, deltas[..., 1, :, :], side=1)


class CandidateSelector(nn.Module):
    """DFlash2's greedy path over each drafted row's top-k tokens with rank-r pairwise scores."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = Linear(hidden_size, rank)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Tokens `[R, P]` for drafted rows `hidden [R, P, H]` (P >= 1) with fp32 `logits [R, P, V]`
        after `anchors [R]`: `choose` over each row's `top_k` tokens of `logits`, in `ops.topk` order. The
        form for callers that hold the whole logits anyway (training); serving takes the candidates
        without them (`DFlashDraftModel.top_candidates`)."""
        return self.choose(hidden, *topk_ops.top_k(logits, self.top_k), anchors)

    def choose(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Tokens `[R, P]` for drafted rows `hidden [R, P, H]` (P >= 1) with `candidates [R, P, k]`
        (token ids) and their fp32 logits `unary [R, P, k]`, after `anchors [R]`; each row's candidates
        in non-increasing order of `unary`, as `topk` returns them.

        The path is sequential but its scores are not: one batched matmul scores every (previous
        candidate, next candidate) pair of every row, one argmax gives each row's best next candidate
        after each possible previous one, and `follow_greedy_path` walks the path through those maps, so
        the launches do not grow with P. Exact ties go to the first (highest-ranked) candidate, as
        argmax picks the first maximum; the pair term is a rank-r sum whose order is the matmul's, so
        a tie exact in one summation order may be broken by the last bit in another."""
        # Only the predecessor depends on earlier choices: fold the row and successor factors first.
        folded = (
            self.successor_codebook[candidates].float() * self.hidden_projection(hidden).float()[:, :, None]
        )
        # Row p's possible predecessors are row p − 1's candidates; row 0's is the anchor (k copies).
        previous = torch.cat([anchors[:, None, None].expand(-1, 1, self.top_k), candidates[:, :-1]], 1)
        pair = self.predecessor_codebook[previous].float() @ folded.transpose(-1, -2)
        best_next = (pair + unary[:, :, None]).argmax(-1)
        return candidates.gather(-1, follow_greedy_path(best_next)[..., None])[..., 0]


def follow_greedy_path(best_next: torch.Tensor) -> torch.Tensor:
    """The candidate index `[R, P]` the greedy path takes in each row, from `best_next [R, P, k]`: row
    p's best candidate after candidate j of row p − 1 (row 0's after the anchor: its k predecessor
    copies are one token, so column 0 is read and f_0 below is constant by construction).

    Row p's choice is (f_p ∘ … ∘ f_1 ∘ f_0)(·) with f_p(j) = best_next[:, p, j]. All P prefixes come
    from a scan of function composition, one gather per round, ceil(log2 P) rounds, after one cat:
    with the caller's gather of the tokens, 2 + ceil(log2 P) launches (5 at P = 7), never more than
    the row-by-row walk's P + 1 (P − 1 gathers, a stack, the token gather) and fewer from P = 4 on."""
    rows, k = best_next.shape[1:]
    # The scan drops `stride` rows at the front each round, Σ strides = 2^rounds − 1 in all; rows in
    # front of row 0 may be anything valid, since the constant f_0 absorbs what is composed before it:
    # copies of f_0 itself.
    dropped = (1 << (rows - 1).bit_length()) - 1
    maps = torch.cat([best_next[:, :1, :1].expand(-1, dropped + 1, k), best_next[:, 1:]], 1)
    stride = 1
    while stride < rows:
        maps = maps[:, stride:].gather(-1, maps[:, :-stride])  # maps[q] <- maps[q + stride] ∘ maps[q]
        stride *= 2
    return maps[..., 0]


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, c.layer_types[index] == "sliding_attention")
        self.mlp = DraftMLP(c)
        self.attention_conv = self.mlp_conv = None
        if c.dflash2 is not None:
            taps, group = c.dflash2.conv_kernel_size, c.dflash2.conv_group_size
            self.attention_conv = GroupedBlockConv(c.hidden_size, taps, group)
            self.mlp_conv = GroupedBlockConv(c.hidden_size, taps, group)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(The layer's output, `next_norm` of it) for its input `x` and `h`, its `input_layernorm` of `x`;
        `attend` is this layer's attention over its context (dense or paged) for the normed block. Each
        residual add and the norm after it are one launch on the GPU (`RMSNorm.after_add`)."""
        x, h = self.post_attention_layernorm.after_add(x, self._around(self.attention_conv, attend, h))
        return next_norm.after_add(x, self._around(self.mlp_conv, self.mlp, h))

    @staticmethod
    def _around(
        conv: GroupedBlockConv | None, sublayer: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor
    ) -> torch.Tensor:
        return sublayer(h) if conv is None else conv(h, sublayer)


class DFlashDraftModel(nn.Module):
    """The checkpoint's tensor names are `layers.linear.unfused_state_dict(model)`'s keys: the parameter
    names, with each `FusedLinear`'s parts (`self_attn.{q,k,v}_proj`, `mlp.{gate,up}_proj`) under their
    own names, rows of the fused weight."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.dflash2 is not None:
            v2 = c.dflash2
            self.candidate_selector = CandidateSelector(
                c.hidden_size, v2.vocab_size, v2.selector_rank, v2.selector_top_k
            )

    def build_rotary(self, positions: int, device) -> None:
        """Rotary tables for positions `0 .. positions-1`, shared by every layer from now on."""
        c = self.config
        table = RotaryTable.build(positions, c.head_dim, c.rope_theta, device)
        for layer in self.layers:
            layer.self_attn.rotary = table

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of committed tokens from their target features `[N, K·H]`."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.key_value(ctx, positions) for layer in self.layers]

    def forward(
        self, block: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Final hidden states `[R, B, H]` of the embedded blocks `[R, B, H]` over gathered context keys
        and values (`ctx_kv[layer]`, `[R, L, kv, d]`, valid where `ctx_valid`)."""
        if len(ctx_kv) != len(self.layers):
            raise ValueError(f"{len(ctx_kv)} context K/V for {len(self.layers)} layers")

        def attend(i: int, h: torch.Tensor) -> torch.Tensor:
            return self.layers[i].self_attn(h, positions, *ctx_kv[i], ctx_pos, ctx_valid)

        return self.stack(block, attend)

    def forward_paged(
        self, block: torch.Tensor, positions: torch.Tensor, context: PagedContext
    ) -> torch.Tensor:
        """The same as `forward` with the context read through the request table: no gather, and no
        host read of the lengths (CUDA-graph safe where the paged kernel takes the call)."""
        return self.stack(block, lambda i, h: self.layers[i].self_attn.paged(h, positions, context, i))

    def stack(self, block: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Final hidden states `[R, B, H]` of the embedded blocks `[R, B, H]`, `attend(i, h)` being layer
        i's attention (any context source: gathered, paged, or training's shared one) of its normed
        block input `h [R, B, H]`. The one layer walk of every path, so they cannot drift apart."""
        x = block * self.config.input_embedding_scale
        h = self.layers[0].input_layernorm(x)
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms_after, strict=True)):
            x, h = layer(x, h, partial(attend, i), next_norm)
        return h

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """DFlash2's fp32 proposal logits `[..., V]`: the head's, scaled by `output_multiplier` and
        soft-capped. Every row over the whole vocabulary: for training, whose loss reads them all."""
        return self.scale_and_cap(lm_head(hidden).float())

    def scale_and_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 head `logits` scaled by `output_multiplier`, then soft-capped (`cap · tanh(x / cap)`).
        Elementwise and non-decreasing (a positive scale, then an increasing function, each rounded
        monotonically), and equal inputs give equal outputs: what `top_candidates` relies on."""
        v2 = self.config.dflash2
        if v2.output_multiplier != 1.0:  # x · 1 == x exactly: skipping it saves a launch, changes no bit
            logits = logits * v2.output_multiplier
        if v2.final_logit_softcapping is not None:
            logits = v2.final_logit_softcapping * torch.tanh(logits / v2.final_logit_softcapping)
        return logits

    def top_candidates(self, hidden: torch.Tensor, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits `[..., k]`, token ids `[..., k]`): the top-k of `self.logits(hidden, lm_head)`
        without the fp32 `[..., V]` tensor: the top-k of the head's own output (bf16 on the GPU;
        `ops.topk.top_k`, one launch on CUDA), then only the k kept values cast, scaled and capped. Safe
        for any head whose output is `[..., V]` logits, -inf for tokens it excludes (`HotTokenHead`,
        whose ids are then global token ids, not map indices).

        Same candidates, same order: `scale_and_cap` after the exact cast is non-decreasing and maps
        equal values to equal values, so where it keeps distinct head values distinct both tensors have
        one order pattern (which entries are <, =, >), and `top_k`'s choice and order depend only on that
        pattern and the positions (by value, equal values by index, on every device). Ties stay ties,
        resolved alike, and the kept values are `logits`' own (up to the last bit of tanh: the CPU's
        vectorised and scalar forms may differ). A positive scale keeps distinct bf16 values distinct
        (neighbours differ by a relative 2^-8, fp32 rounds by at most 2^-24, barring overflow); fp32 head
        values (CPU) can merge in the rounding of the scale, and either can merge where tanh saturates
        (|x / cap| beyond ~7 for bf16 inputs; from ~9 fp32 tanh is ±1).

        Where values merge, `logits` sees a tie and `top_k` breaks it by index; here the higher
        head value ranks first. The token at the k-th place, or the order of candidates with equal capped
        logits, may then differ: both are valid top-k orders of the capped logits, the draft scores the
        tied tokens alike, and the target verifies every draft, so outputs cannot change (only, rarely,
        which draft is proposed). One such case improves: a head's -inf (outside a token map) capped to
        -cap could tie with map tokens saturated at -cap and become a candidate; here it never does
        while the map holds k tokens (the proposer checks it)."""
        raw, candidates = topk_ops.top_k(lm_head(hidden), self.config.dflash2.selector_top_k)
        return self.scale_and_cap(raw.float()), candidates

    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: VocabHead) -> torch.Tensor:
        """Draft tokens `[R, B−1]` from the drafted rows' hidden states `[R, B−1, H]`: the head's
        argmax for DFlash, the candidate selector's path after `anchors [R]` for DFlash2."""
        if self.config.dflash2 is None:
            return lm_head.argmax(hidden)
        return self.candidate_selector.choose(hidden, *self.top_candidates(hidden, lm_head), anchors)
