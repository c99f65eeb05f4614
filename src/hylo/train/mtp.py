"""`hylo train-draft --algorithm mtp`: the MTP (next-n) layer's training objective and its export.

The function trained is the one `hylo.models.mtp` serves (see its docstring for the math and the
position convention): entry i pairs the target hidden h_i (the mean of the last target layer's
streams, the `features` of hylo's forward with `capture_layers = (num_hidden_layers - 1,)`) with
token i+1 and predicts token i+2, attending causally, through the DSA indexer's selection, to the
entries of its sequence.

Why a forward of its own. hylo's `MTPLayer` is inference code: it writes paged caches in place and
its DSA, mHC and MoE ops are Triton kernels on CUDA, with no backward. The training layer therefore
computes over whole sequences, in plain differentiable torch:

- the decoder layer is `transformers`' `Glm5NextTextDecoderLayer` (the reference implementation that
  hylo's parity tests hold hylo's forward to, and that `hylo train` trains the demo target with),
  built from the one-layer `mtp_config`. Its mHC hyper-connections, norms and MLP / MoE are called as
  they are; its attention block is recomputed here from its own parameters, because chained steps
  attend to keys of two kinds (below), which HF's attention forward cannot express;
- enorm / hnorm / shared_head.norm are hylo's `RMSNorm` (plain torch), eh_proj an `nn.Linear`;
- the parameter names are exactly `MTPLayer`'s (the HF layer's names are the checkpoint's), so the
  loader's own table (`mtp_layout`) exports the layer and `load_mtp_layer` reads it back.

Running hylo's `MTPLayer` itself through fresh fp32 caches with autograd was the alternative: it would
backpropagate on the CPU references only (not through the CUDA kernels), and chained steps would need
a cache row per base entry (each base's chain overwrites positions the others read).

Attention. The DSA selection is hylo's inference selection (`hylo.ops.indexer.reference.select_rows`)
rewritten over whole sequences: the same k-pool compression, the same score, ties to the earlier pool,
the tail pool appended; so it agrees for sequences of any length, not only those shorter than
`index_topk` where everything visible is selected (the tests check sequences several times longer).
The indexer takes no gradient (its top-k is a selection, as in `transformers`): its parameters are
frozen at their initialisation. The attention itself is the non-absorbed MLA form of hylo's absorbed
one (keys and values `kv_b_proj(latent)`), over a dense mask of the selected entries.

Chained steps (`steps` > 1) run as chained drafting does at inference, with the true tokens in place
of the drafts (teacher forcing on tokens, own hiddens): step j's entry for base i sits at position
p = i + j - 1, pairs step j-1's MTP hidden of base i with token i+j and predicts token i+j+1. Like the
drafting query at p, it attends to the step-1 entries at positions <= i and to its own chain's entries
at i+1 .. p (steps 2 .. j of base i): k-pools completed by chain entries are compressed from both, and
the selection runs over that cache. Gradients flow through every step (the chained hiddens and the
step-1 keys they attend to).

Loss: per step, the mean cross-entropy over the entries whose target token exists and is in
`loss_mask`; steps weighted `step_decay ** (j - 1)` (default 0.6, about the chance that a draft is
reached given the previous one was accepted) and normalised by the sum of the weights used.

Memory: one step holds `[S, heads, L, L]` fp32 attention scores (a dense mask, like HF's eager
attention), plus the indexer's `[S, L, index_heads, L / kpool]` scores (no gradient).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hylo.config import ModelConfig
from hylo.layers.linear import unfused_state_dict
from hylo.layers.moe import FP8Experts
from hylo.layers.norm import RMSNorm
from hylo.models.glm5_next import DecoderLayer, Glm5NextForCausalLM
from hylo.models.loader import CheckpointError, checkpoint_layout, checkpoint_tensors, mtp_layout
from hylo.models.mtp import MTPLayer, mtp_config
from hylo.ops.fp8 import dequantize_fp8_blocks

MTP_FILE = "mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_STEP_DECAY = 0.6


def hf_text_config(config: ModelConfig):
    """The `transformers` text config of hylo's `config` (`num_key_value_heads` = the heads: MLA; the
    routed experts run by HF's plain per-expert loop)."""
    from transformers import Glm5NextTextConfig

    known = {f.name for f in dataclasses.fields(Glm5NextTextConfig)}
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k in known}
    return Glm5NextTextConfig(
        **fields, num_key_value_heads=config.num_attention_heads, experts_implementation="eager"
    )


@dataclass(frozen=True)
class Entries:
    """What one MTP step leaves in the cache for every base entry i of `S` sequences (`N` bases):
    attention keys `key [S, N, heads, nope]` and values `value [S, N, heads, v]` (from the latent),
    indexer keys and k-pool gates `index_key`, `index_gate [S, N, d]` (no gradient)."""

    key: torch.Tensor
    value: torch.Tensor
    index_key: torch.Tensor
    index_gate: torch.Tensor


class SharedHead(nn.Module):
    """`shared_head.norm` only: the MTP layer uses the target's `lm_head` (no `shared_head.head`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPTrainLayer(nn.Module):
    """The trainable MTP layer: `MTPLayer`'s parameters under `MTPLayer`'s names, with no embedding and
    no head of its own (the target's are used), computing over whole sequences. `config` is the
    one-layer `mtp_config` of the target."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

        h = config.hidden_size
        self.config = config
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.decoder = Glm5NextTextDecoderLayer(hf_text_config(config), 0)
        self.shared_head = SharedHead(config)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, earlier: list[Entries]
    ) -> tuple[torch.Tensor, Entries]:
        """One step for every base entry: `embeds`, `hidden [S, N, H]` (its token's embedding and the
        hidden paired with it), `earlier` the entries of the steps before (empty for step 1). Returns
        the MTP hiddens `[S, N, H]` and this step's entries."""
        dec = self.decoder
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        streams = x[:, :, None, :].expand(-1, -1, self.config.hc_mult, -1).contiguous()
        post, comb, block_in = dec.attn_hc(streams)
        out, own = self._attention(dec.input_layernorm(block_in), earlier)
        streams = _hc_post(out, streams, post, comb)
        post, comb, block_in = dec.ffn_hc(streams)
        streams = _hc_post(dec.mlp(dec.post_attention_layernorm(block_in)), streams, post, comb)
        return streams.mean(dim=2), own

    def _attention(self, x: torch.Tensor, earlier: list[Entries]) -> tuple[torch.Tensor, Entries]:
        """The DSA block on `x [S, N, H]` (after `input_layernorm`): this step's queries over the step-1
        entries and the chain's, as selected at inference."""
        c, attn = self.config, self.decoder.self_attn
        heads, nope = c.num_attention_heads, c.qk_nope_head_dim
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid).unflatten(-1, (heads, nope))
        kv = attn.kv_b_proj(attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x))).unflatten(-1, (heads, -1))
        key, value = kv.split([nope, c.v_head_dim], dim=-1)
        index_q, head_weights, index_key, index_gate = self._indexer(x, q_resid)
        own = Entries(key, value, index_key, index_gate)
        base, chain = (own, []) if not earlier else (earlier[0], [*earlier[1:], own])
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            see_base, see_chain = select_entries(
                index_q, head_weights, base.index_key, base.index_gate,
                _stack(chain, "index_key", base.index_key), _stack(chain, "index_gate", base.index_gate),
                attn.indexer.index_kpool_compress_ape, c.index_topk, c.index_kpool_always_select_tail,
            )  # fmt: skip
        out = _masked_attention(q, base, chain, see_base, see_chain, nope**-0.5)
        return attn.o_proj(out.flatten(-2)), own

    @torch.no_grad()
    def _indexer(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(queries `[S, N, Hi, d]` scaled by d^-1/2, fp32 head weights `[S, N, Hi]` scaled by Hi^-1/2,
        keys and k-pool gates `[S, N, d]`), as hylo's `Indexer` computes them; no gradient (they only
        select)."""
        indexer = self.decoder.self_attn.indexer
        d, heads = indexer.head_dim, indexer.n_heads
        q = indexer.wq_b(q_resid).unflatten(-1, (heads, d)) * d**-0.5
        head_weights = indexer.weights_proj(x).float() * heads**-0.5
        return q, head_weights, indexer.k_norm(indexer.wk(x)), x @ indexer.index_kpool_compress_gate.t()


def _hc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """A block's output back into the streams, as `Glm5NextTextDecoderLayer` mixes it."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[..., None, :] + comb.to(dtype).transpose(-1, -2) @ streams


def _stack(chain: list[Entries], name: str, like: torch.Tensor) -> torch.Tensor:
    """`[S, N, E, ...]`: the chain entries' `name` along a new dim 2 (E = 0 for step 1)."""
    if not chain:
        return like.new_zeros(*like.shape[:2], 0, *like.shape[2:])
    return torch.stack([getattr(e, name) for e in chain], dim=2)


def _compress_pools(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, dim: int) -> torch.Tensor:
    """Pooled keys of the complete pools of `keys, gates [..., n, ..., d]` along `dim` (pool m: entries
    kpool·m .. kpool·m + kpool-1), `[..., n // kpool, ..., d]`: per channel, the softmax over the pool
    of gate + ape weighting the keys (`hylo.ops.indexer.reference.compress_pools`)."""
    kpool = ape.shape[0]
    count = keys.shape[dim] // kpool

    def pools(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, 0, count * kpool).unflatten(dim, (count, kpool))

    weights = torch.softmax(pools(gates).float() + ape.float(), dim=dim + 1).to(keys.dtype)
    return (weights * pools(keys)).sum(dim + 1)


def _pool_scores(
    q: torch.Tensor, head_weights: torch.Tensor, pooled: torch.Tensor, equation: str
) -> torch.Tensor:
    """Σ_h w_h · ReLU(q_h · k_pool) in fp32, as `select_rows` scores."""
    scores = torch.relu(torch.einsum(equation, q.float(), pooled.float()))
    return torch.einsum("snh,snhp->snp", head_weights.float(), scores)


@dataclass(frozen=True)
class _Window:
    """For every base i, the positions from kpool·⌊(i+1)/kpool⌋, the first not in a pool of step-1
    entries alone, to the query's position p = i + E and (unused) beyond: `[N, kpool-1+E]`, the most
    that range holds. `from_chain`: the position holds a chain entry (> i); `base_pos` / `chain_pos`:
    its index among the step-1 entries / the base's chain entries (clamped where it holds none);
    `tail`: the position is in p's own incomplete pool (at or before p). `chain`: E."""

    chain: int
    positions: torch.Tensor
    from_chain: torch.Tensor
    base_pos: torch.Tensor
    chain_pos: torch.Tensor
    tail: torch.Tensor

    @classmethod
    def build(cls, n: int, e: int, kpool: int, device: torch.device) -> _Window:
        base = torch.arange(n, device=device)[:, None]
        query = base + e
        positions = (base + 1) // kpool * kpool + torch.arange(kpool - 1 + e, device=device)
        tail = (positions >= (query + 1) // kpool * kpool) & (positions <= query)
        chain_pos = (positions - base - 1).clamp(0, max(e - 1, 0))
        return cls(e, positions, positions > base, positions.clamp(max=n - 1), chain_pos, tail)

    def gather(self, base_t: torch.Tensor, chain_t: torch.Tensor) -> torch.Tensor:
        """`[S, N, width, d]`: the entries' values, from `base_t [S, N, d]` and `chain_t [S, N, E, d]`."""
        out = base_t[:, self.base_pos]
        if self.chain:
            rows = torch.arange(len(self.positions), device=out.device)[:, None]
            out = torch.where(self.from_chain[..., None], chain_t[:, rows, self.chain_pos], out)
        return out


def select_entries(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    base_key: torch.Tensor,
    base_gate: torch.Tensor,
    chain_key: torch.Tensor,
    chain_gate: torch.Tensor,
    ape: torch.Tensor,
    topk: int,
    tail: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries hylo's DSA indexer selects for the query of every base i, at position p = i + E.

    The cache the query sees holds the step-1 entries `base_key, base_gate [S, N, d]` at positions
    0 .. i and base i's chain entries `chain_key, chain_gate [S, N, E, d]` at i+1 .. i+E (E = 0 for
    step 1). q `[S, N, Hi, d]` (scaled by d^-1/2), head_weights `[S, N, Hi]`, ape `[kpool, d]`.
    Selection as `hylo.ops.indexer.reference.select_rows`: k-pools are positions kpool·m ..
    kpool·m + kpool-1; a pool is a candidate once its last position is <= p; the top topk/kpool
    candidates by score (ties to the earlier pool) are expanded to their positions, plus (`tail`) the
    positions of p's own incomplete pool. Pools ending at or before i hold step-1 entries alone and are
    compressed once; the few after them (ending in i+1 .. p) mix in chain entries and are compressed
    per base, from the `_Window` of positions past the last step-1-only pool.

    Returns (selected step-1 entries `[S, N, N]`: [s, i, m] for position m <= i; selected chain entries
    `[S, N, E]`).
    """
    n, e, kpool = base_key.shape[1], chain_key.shape[2], ape.shape[0]
    base = torch.arange(n, device=base_key.device)
    shared_pools, visible_pools = (base + 1) // kpool, (base + e + 1) // kpool
    window = _Window.build(n, e, kpool, base_key.device)
    shared_keys = _compress_pools(base_key, base_gate, ape, dim=1)  # [S, P, d]
    window_keys = _compress_pools(
        window.gather(base_key, chain_key), window.gather(base_gate, chain_gate), ape, dim=2
    )  # [S, N, M, d]
    # Candidates: the step-1 pools in order, then the window's. Every valid window pool comes after
    # every valid step-1 pool in pool order, so the stable sort breaks ties to the earlier pool as hylo.
    scores = torch.cat(
        [
            _pool_scores(q, head_weights, shared_keys, "snhd,spd->snhp"),
            _pool_scores(q, head_weights, window_keys, "snhd,snpd->snhp"),
        ],
        dim=-1,
    )
    valid = torch.cat(
        [
            _below(shared_keys.shape[1], shared_pools),
            _below(window_keys.shape[2], visible_pools - shared_pools),
        ],
        dim=-1,
    )  # [N, candidates]
    order = scores.masked_fill(~valid, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    chosen = order[..., : topk // kpool]
    chosen = torch.where(valid[base[:, None], chosen], chosen, -1)
    return _expand(chosen, shared_keys.shape[1], window, kpool, tail)


def _below(count: int, limit: torch.Tensor) -> torch.Tensor:
    """`[N, count]`: index < limit[i]."""
    return torch.arange(count, device=limit.device) < limit[:, None]


def _expand(
    chosen: torch.Tensor, num_pools: int, window: _Window, kpool: int, tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of the chosen candidates `[S, N, k]` (< num_pools: a step-1 pool; else a window
    pool; -1: none) and, with `tail`, of each query's incomplete pool, as (step-1 mask, chain mask)."""
    n, width = window.positions.shape
    offsets = torch.arange(kpool, device=chosen.device)
    rows = chosen[..., None] * kpool + offsets
    shared = torch.where(((chosen >= 0) & (chosen < num_pools))[..., None], rows, n).flatten(-2)
    in_window = torch.where((chosen >= num_pools)[..., None], rows - num_pools * kpool, width).flatten(-2)
    in_window = _scatter_mask(in_window, width)
    if tail:
        in_window = in_window | window.tail
    from_base = torch.where(in_window & ~window.from_chain, window.base_pos, n)
    see_base = _scatter_mask(torch.cat([shared, from_base], dim=-1), n)
    see_chain = _scatter_mask(
        torch.where(in_window & window.from_chain, window.chain_pos, window.chain), window.chain
    )
    return see_base, see_chain


def _scatter_mask(index: torch.Tensor, size: int) -> torch.Tensor:
    """`[..., size]` bool, True at `index [..., K]` (entries equal to `size` mark nothing)."""
    mask = torch.zeros(*index.shape[:-1], size + 1, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, index, True)[..., :size]


def _masked_attention(
    q: torch.Tensor,
    base: Entries,
    chain: list[Entries],
    see_base: torch.Tensor,
    see_chain: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`[S, N, heads, v]`: each query `q [S, N, heads, nope]` over the step-1 entries it selects
    (`see_base [S, N, N]`) and its own chain's (`see_chain [S, N, E]`); softmax in fp32."""
    scores = torch.einsum("snhd,smhd->shnm", q, base.key)
    mask = see_base
    if chain:
        chain_key, chain_value = _stack(chain, "key", base.key), _stack(chain, "value", base.value)
        scores = torch.cat([scores, torch.einsum("snhd,snehd->shne", q, chain_key)], dim=-1)
        mask = torch.cat([see_base, see_chain], dim=-1)
    scores = scores.float().mul(scale).masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    n = see_base.shape[-1]
    out = torch.einsum("shnm,smhv->snhv", probs[..., :n], base.value)
    if chain:
        out = out + torch.einsum("shne,snehv->snhv", probs[..., n:], chain_value)
    return out


def init_mtp_layer(target: Glm5NextForCausalLM, seed: int = 0) -> MTPTrainLayer:
    """A trainable MTP layer for `target`, fp32 on the target's device: a DSA layer with its own
    indexer and the MLP type of the target's last layer, using the target's embedding and head.

    The decoder layer starts as a copy of the target's: its attention half (attention hyper-connection,
    input norm, sparse MLA and indexer) from the last DSA layer with its own indexer (the indexer's
    queries read that layer's `q_a_proj`), its MLP half (MLP hyper-connection, post-attention norm,
    MLP or MoE, FP8 experts dequantised) from the last layer. enorm and hnorm start at 1,
    shared_head.norm as the target's final norm (the head it feeds is the target's), eh_proj random
    (std (2H)^-1/2: unit-RMS inputs give a unit-RMS stream), from `seed`. The indexer stays frozen
    (`requires_grad` False): its selection takes no gradient. So does the router's score-correction
    bias, a buffer (DeepSeek-style load balancing moves it outside the gradient).
    """
    c = target.config
    if not c.indexer_layers:
        raise ValueError("the target has no DSA layer with its own indexer to start the MTP layer from")
    device = target.embed_tokens.weight.device
    with torch.device("meta"):
        layer = MTPTrainLayer(mtp_config(c, c.mlp_layer_types[-1]))
    layer = layer.to_empty(device=device)
    attention, mlp = target.layers[c.indexer_layers[-1]], target.layers[-1]
    dec = layer.decoder
    with torch.no_grad():
        for name in ("attn_hc", "input_layernorm", "self_attn"):
            getattr(dec, name).load_state_dict(unfused_state_dict(getattr(attention, name)))
        for name in ("ffn_hc", "post_attention_layernorm"):
            getattr(dec, name).load_state_dict(getattr(mlp, name).state_dict())
        dec.mlp.load_state_dict(_mlp_state(mlp))
        layer.enorm.weight.fill_(1)
        layer.hnorm.weight.fill_(1)
        layer.shared_head.norm.weight.copy_(target.norm.weight)
        gen = torch.Generator(device).manual_seed(seed)
        std = layer.eh_proj.in_features**-0.5
        layer.eh_proj.weight.copy_(
            torch.randn(layer.eh_proj.weight.shape, generator=gen, device=device) * std
        )
    dec.self_attn.indexer.requires_grad_(False)
    return layer


def _mlp_state(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """The MLP's state dict with its fused projections under their parts' names (`unfused_state_dict`)
    and FP8 routed experts dequantised to fp32 (`Experts`' names)."""
    state = unfused_state_dict(layer.mlp)
    experts = getattr(layer.mlp, "experts", None)
    if isinstance(experts, FP8Experts):
        for name in ("gate_up_proj", "down_proj"):
            scale = state.pop(f"experts.{name}_scale_inv")
            state[f"experts.{name}"] = dequantize_fp8_blocks(state[f"experts.{name}"], scale, torch.float32)
    return state


class MTPObjective:
    """The MTP training loss of `layer` for the frozen `target`: the target's embedding and head are
    read, detached (no gradient ever reaches the target), and nothing of the target is registered in
    `layer` (the trainer saves and optimises `layer` alone)."""

    def __init__(
        self, layer: MTPTrainLayer, target: Glm5NextForCausalLM, step_decay: float = DEFAULT_STEP_DECAY
    ):
        if (
            layer.config.hidden_size != target.config.hidden_size
            or layer.config.vocab_size != target.config.vocab_size
        ):
            raise ValueError("the MTP layer was not made for this target (hidden or vocabulary size differs)")
        if not step_decay > 0:
            raise ValueError(f"step_decay must be > 0, got {step_decay}")
        self.layer, self.step_decay = layer, step_decay
        self._embedding, self._head = target.embed_tokens.weight, target.lm_head.weight

    def hiddens(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Step j's MTP hidden `[S, L-1, H]` of every base i = 0 .. L-2 for j = 1 .. `steps`, from
        `tokens [S, L]` and the target hiddens `hidden [S, L, H]`. Step j at base i pairs step j-1's
        hidden (for j = 1, h_i) with token i+j and predicts token i+j+1; where i+j >= L the token is
        the last one (such entries have no target and, causal, change no other)."""
        s, length = tokens.shape
        if length < 2 or hidden.shape[:2] != (s, length):
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and hidden {tuple(hidden.shape)}: need [S, L >= 2(, H)]"
            )
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        dtype = self.layer.eh_proj.weight.dtype
        base = torch.arange(length - 1, device=tokens.device)
        h, earlier, out = hidden[:, :-1].to(dtype), [], []
        for j in range(1, steps + 1):
            ids = tokens[:, (base + j).clamp(max=length - 1)]
            h, own = self.layer(F.embedding(ids, self._embedding.detach()).to(dtype), h, earlier)
            earlier.append(own)
            out.append(h)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of MTP hiddens: the target's head on `shared_head.norm(hidden)`."""
        head = self._head.detach()
        return F.linear(self.layer.shared_head.norm(hidden).to(head.dtype), head).float()

    def loss(
        self, tokens: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor, steps: int = 1
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(weighted loss, stats) for `tokens [S, L]`, target hiddens `hidden [S, L, H]` and
        `loss_mask [S, L]` (True where a token is a training target; sequences right-padded, the
        padding out of the mask: causal attention keeps it from the entries before it). Stats per
        step j: `mtp_loss_{j}` (mean cross-entropy, nats), `mtp_acc_{j}` (top-1 accuracy: how often a
        greedy draft would be right) and `mtp_tokens_{j}` (targets counted)."""
        total, weights, stats = 0.0, 0.0, {}
        for j, g in enumerate(self.hiddens(tokens, hidden, steps), start=1):
            ce, step_stats = self._step_loss(j, g, tokens, loss_mask)
            weight = self.step_decay ** (j - 1)
            total, weights = total + weight * ce, weights + weight
            stats |= step_stats
        return total / weights, stats

    def _step_loss(
        self, j: int, g: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Step j's mean cross-entropy over the bases whose target, token i+j+1, exists and is in the
        mask (0, still a graph node, when there is none), and its stats."""
        length = tokens.shape[1]
        target_pos = torch.arange(j + 1, length + j, device=tokens.device)
        valid = (target_pos < length) & loss_mask[:, target_pos.clamp(max=length - 1)]
        targets = tokens[:, target_pos.clamp(max=length - 1)][valid]
        logits = self.logits(g[valid])
        count = targets.numel()
        ce = F.cross_entropy(logits, targets, reduction="sum") / max(count, 1)
        correct = (logits.detach().argmax(-1) == targets).sum().item()
        return ce, {
            f"mtp_loss_{j}": ce.item(),
            f"mtp_acc_{j}": correct / max(count, 1),
            f"mtp_tokens_{j}": count,
        }


def export_mtp_layer(
    layer: MTPTrainLayer, target_dir: str | Path, dtype: torch.dtype | None = None, fp8: bool | None = None
) -> Path:
    """Write `layer` into the target's checkpoint directory as its MTP layer: `mtp.safetensors` (replaced
    atomically) with `model.language_model.layers.{num_hidden_layers}.*`, the names `load_mtp_layer`
    reads, and those names added to `model.safetensors.index.json` when the directory has one (the
    target loader skips them). Returns the file written.

    `dtype`: cast the fp32 parameters (not those kept in fp32, nor buffers) to it; default: as trained.
    `fp8`: block-scaled e4m3 projection weights, as FP8 checkpoints store them (an FP8 target loads
    its MTP layer's routed experts as FP8); default: when the target's config is FP8-quantised.
    Raises `CheckpointError` when another file of the directory already holds an MTP layer."""
    target_dir = Path(target_dir)
    config = ModelConfig.from_dir(target_dir)
    n = config.num_hidden_layers
    if layer.config != mtp_config(config, layer.config.mlp_layer_types[0]):
        raise ValueError(f"the MTP layer was not made for the target at {target_dir} (its config differs)")
    _check_layout(layer)
    _check_no_other_mtp_layer(target_dir, n)
    if fp8 is None:
        fp8 = (config.quantization_config or {}).get("quant_method") == "fp8"
    tensors = checkpoint_tensors(layer, mtp_layout(layer, n), fp8, dtype)
    path = target_dir / MTP_FILE
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, path)
    _add_to_index(target_dir, list(tensors))
    return path


def _check_layout(layer: MTPTrainLayer) -> None:
    """The layer's checkpoint names and shapes are those of the `MTPLayer` `load_mtp_layer` builds."""
    with torch.device("meta"):
        expected = checkpoint_layout(MTPLayer(layer.config, own_embedding=False, own_head=False))
    actual = checkpoint_layout(layer)
    if {k: s.shape for k, s in actual.items()} != {k: s.shape for k, s in expected.items()}:
        diff = sorted(set(actual).symmetric_difference(expected)) or "shapes differ"
        raise ValueError(f"the MTP layer's tensors are not hylo's MTPLayer's: {diff}")


def _check_no_other_mtp_layer(target_dir: Path, n: int) -> None:
    """Two files holding the MTP layer (the names `load_mtp_layer` reads) would both be loaded, the later
    one winning."""
    name = re.compile(rf"^(model\.(language_model\.)?)?layers\.{n}\.")
    for file in sorted(target_dir.glob("*.safetensors")):
        if file.name == MTP_FILE:
            continue
        with safe_open(str(file), framework="pt") as f:
            found = next((k for k in f.keys() if name.match(k)), None)  # noqa: SIM118 (not iterable)
        if found is not None:
            raise CheckpointError(
                f"{file} already holds an MTP layer ({found}): export into a copy of the checkpoint "
                "without it"
            )


def _add_to_index(target_dir: Path, names: list[str]) -> None:
    """Point `names` at `mtp.safetensors` in the directory's index (if any), dropping the entries of
    an earlier export, and keep its `total_size` the sum of the listed files' tensor bytes."""
    index = target_dir / INDEX_FILE
    if not index.is_file():
        return
    raw = json.loads(index.read_text())
    weight_map = {k: v for k, v in raw["weight_map"].items() if v != MTP_FILE}
    weight_map |= dict.fromkeys(names, MTP_FILE)
    raw["weight_map"] = dict(sorted(weight_map.items()))
    if "total_size" in raw.get("metadata", {}):
        raw["metadata"]["total_size"] = sum(_tensor_bytes(target_dir / f) for f in set(weight_map.values()))
    partial = index.with_suffix(".partial")
    partial.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(partial, index)


def _tensor_bytes(file: Path) -> int:
    """Bytes of a safetensors file's tensor data: the file less its 8-byte length and its header."""
    with file.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return file.stat().st_size - 8 - header
