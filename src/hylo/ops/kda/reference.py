"""Torch reference of the KDA ops: causal conv with a carried window, safe gate, chunked delta rule,
sigmoid-gated RMSNorm. Sequences are right-padded `[B, T, ...]`; padded steps carry g = 0 and β = 0,
which leaves the state exactly unchanged, so one call serves prefill, chunked prefill and decode."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hylo.ops.fp8 import dequantize_fp8_blocks


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over `x [B, T, C]` continuing from `window [B, K-1, C]`.

    `weight [C, K]` (fp32) is applied in its own dtype. Returns the output `[B, T, C]` in x's dtype
    and the new window: the last K-1 inputs before each sequence's end (`lengths [B]`).
    """
    width = weight.shape[1]
    z = torch.cat([window.to(x.dtype), x], dim=1)
    taps = z.unfold(1, width, 1)[:, : x.shape[1]]  # [B, T, C, K]
    y = F.silu((taps.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
    keep = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]
    new_window = z.gather(1, keep[..., None].expand(-1, -1, z.shape[-1]))
    return y, new_window


def kda_gate(
    f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log forget gate from raw `f [..., H, d]`: safe gate `lb·σ(e^A·(f+b))` when bounded."""
    x = f.float() + dt_bias.float().view(f.shape[-2:])
    rate = torch.exp(a_log.float())[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x, threshold=20.0)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule `S_t = (I - β_t k_t k_tᵀ) diag(e^{g_t}) S_{t-1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ q_t`.

    q, k, v: `[B, T, H, d]`; g: `[B, T, H, d_k]` (log decay); beta: `[B, T, H]`; state `[B, H, d_k, d_v]`
    fp32. q and k are L2-normalised here and q scaled by d_k^-1/2, all in fp32. Within a chunk the
    accepted updates U solve a unit-lower-triangular system; decays enter only as differences of
    cumulative gates inside the chunk, so nothing overflows however long the sequence.
    Returns o `[B, T, H, d_v]` in q's dtype and the final state (fp32).
    """
    out_dtype = q.dtype
    q, k, v, g = (t.float().transpose(1, 2) for t in (q, k, v, g))  # [B, H, T, d]
    beta = beta.float().transpose(1, 2)
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    length = q.shape[2]
    c = min(chunk_size, length)
    pad = (-length) % c
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    s = state.float()
    outs = []
    for start in range(0, length + pad, c):
        qc, kc, vc, bc = (t[:, :, start : start + c] for t in (q, k, v, beta))
        gc = g[:, :, start : start + c].cumsum(2)
        decay = torch.exp(
            (gc[:, :, :, None] - gc[:, :, None, :]).masked_fill(~causal[..., None], float("-inf"))
        )
        kk = torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, decay)
        qk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)
        system = torch.eye(c, device=q.device) + bc[..., None] * kk * strict
        rhs = bc[..., None] * (vc - (kc * gc.exp()) @ s)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append((qc * gc.exp()) @ s + qk @ u)
        last = gc[:, :, -1]
        s = last.exp()[..., None] * s + (kc * torch.exp(last[:, :, None] - gc)).transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2)[:, :, :length].transpose(1, 2)
    return o.to(out_dtype), s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head `RMSNorm(x)·w·σ(gate)` over the last dim, all in fp32, cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


# ---- packed serving API: the references the Triton kernels are checked against ----------------------
# Tokens are packed sequence after sequence (`[N, ...]`, offsets `cu_seqlens`), or `[B, T, ...]` for the
# fixed-length decode/verify steps. q/k/v are the pre-conv projections `[.., H·d]`, f the raw gate
# `[.., H·d]`, b the raw β logits `[.., H]`; `conv_pool [slots, K-1, 3·H·d]` and `state_pool
# [slots, H, d, d]` (fp32) are one layer's views of the slot pool, read and written at `slot_ids`.


@dataclass(frozen=True)
class KDAInputs:
    """A layer's projected inputs of a step's tokens: `q`, `k`, `v` `[N, H, d]`, the gate's
    pre-activation `f` `[N, H, d]` and β's logits `b` `[N, H]` (a decode step's f and b may be `LowRank`,
    which `decode` alone takes)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f: torch.Tensor | LowRank
    b: torch.Tensor | LowRank

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.f, self.b)

    def rows(self, index: torch.Tensor) -> KDAInputs:
        """The tokens `index` (any index of the token dimension) of every input."""
        return KDAInputs(*(t[index] for t in self.tensors))

    def blocks(self, width: int) -> KDAInputs:
        """Every input's packed tokens as `[tokens / width, width, ...]` blocks, viewed (no copy)."""
        return KDAInputs(*(t.unflatten(0, (-1, width)) for t in self.tensors))


@dataclass(frozen=True)
class KDAParams:
    """A layer's own parameters: the short convolution's weight, the gate's `dt_bias` and `a_log`,
    and its lower bound (None: the plain gate; -5 ≤ lower_bound < 0 is the safe gate that the chunked
    Triton prefill and the one-block verify need)."""

    conv_weight: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    lower_bound: float | None


@dataclass(frozen=True)
class KDASlots:
    """The step's sequences in a layer's state pools: `conv_pool` (windows), `state_pool` (fp32 S),
    and each sequence's slot in them, `slot_ids [B]`."""

    conv_pool: torch.Tensor
    state_pool: torch.Tensor
    slot_ids: torch.Tensor

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conv_pool, self.state_pool, self.slot_ids)


@dataclass(frozen=True)
class OutputNorm:
    """A layer's output norm: the gate `[N, H, d]` (before its sigmoid; a decode step may give it as
    `LowRank` factors, `[N, H·d]` once computed), the per-head `weight [d]` and `eps` of
    `gated_rms_norm`."""

    gate: torch.Tensor | LowRank
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class LowRank:
    """A per-head input `[N, H·d]` given by its factors, not yet multiplied: the input `a [N, r]` and the
    projection `weight [H·d, r]`, e4m3 with per-[128, 128]-block `scale_inv` or in a's dtype (None), as
    `ops.gemm.linear(a, weight, scale_inv)` would compute it. A decode step hands the gate's f and the
    output norm's gate so (r = d: the low-rank f_a|g_a times f_b, g_b), and β's logits where they are
    the dense part of an FP8 projection (d = 1, r the hidden size: the layer input times b_proj's rows):
    the kernels that read them compute their heads' rows from the factors, in place of the projection
    launches (`dense` is what the references read)."""

    a: torch.Tensor
    weight: torch.Tensor
    scale_inv: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """`a @ weightᵀ` in a's dtype, the weight dequantised to it first (`ops.gemm`'s reference)."""
        weight = self.weight
        if self.scale_inv is not None:
            weight = dequantize_fp8_blocks(weight, self.scale_inv, self.a.dtype)
        return F.linear(self.a, weight)


def dense(x: torch.Tensor | LowRank) -> torch.Tensor:
    """x, multiplied out where it is `LowRank`."""
    return x.dense() if isinstance(x, LowRank) else x


@dataclass
class VerifyCache:
    """What `commit` needs from a verify step: its inputs `x` (`[B, T, ...]`) and, from the Triton path,
    the conv output `qkv [B, T, 3·H·d]` so the replay need not recompute it."""

    x: KDAInputs
    qkv: torch.Tensor | None = None


def _pad_plan(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor(lengths)
    steps = torch.arange(max(lengths))
    valid = steps[None, :] < lens[:, None]
    index = torch.where(valid, (torch.cumsum(lens, 0) - lens)[:, None] + steps[None, :], 0)
    return index.to(device), valid.to(device)


# Tokens per chunk of the chunked prefill (the Triton kernel's tile); snapshots inside a prefill fall
# on its multiples (`ChunkSnapshots`).
CHUNK_TOKENS = 64


@dataclass(frozen=True)
class ChunkSnapshots:
    """Snapshots a prefill leaves inside its sequences: after the packed chunk c (`CHUNK_TOKENS`
    tokens each, counted over the batch's sequences in order) that ends before its sequence does, the
    conv window and state go to snapshot `chunk_ids[c]` (int64, device; -1: none) of one KDA layer's
    snapshot pools `conv [S, W-1, 3·H·d]` and `state [S, H, d, d]`. (The state after a sequence's
    last token is its slot's.)"""

    chunk_ids: torch.Tensor
    conv: torch.Tensor
    state: torch.Tensor


def prefill(
    x: KDAInputs,
    params: KDAParams,
    slots: KDASlots,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: list[int] | None,
    snapshots: ChunkSnapshots | None = None,
) -> torch.Tensor:
    """Conv + SiLU, gate, β, L2-normalised chunked delta rule over packed sequences; the slot windows
    and states are read, then overwritten with each sequence's final ones. Returns o `[N, H, d]`.

    Without `cu_seqlens_cpu` the offsets are read from `cu_seqlens` (a padded batch: tokens from
    `cu_seqlens[-1]` to N belong to no sequence and get zero outputs). `snapshots`: see
    `ChunkSnapshots`; here each sequence runs in segments ending at them."""
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.tolist()
    if snapshots is not None:
        return _prefill_in_segments(x, params, slots, cu_seqlens_cpu, snapshots)
    conv_pool, state_pool, slot_ids = slots.tensors
    heads = tuple(state_pool.shape[1:3])
    lengths = [e - s for s, e in itertools.pairwise(cu_seqlens_cpu)]
    index, valid = _pad_plan(lengths, x.q.device)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return t[index] * valid.view(*valid.shape, *([1] * (t.dim() - 1)))

    y, window = causal_conv(
        pad(torch.cat([x.q, x.k, x.v], -1)),
        conv_pool[slot_ids],
        params.conv_weight,
        torch.tensor(lengths, device=x.q.device),
    )
    conv_pool[slot_ids] = window.to(conv_pool.dtype)
    qq, kk, vv = (t.unflatten(-1, heads) for t in y.chunk(3, dim=-1))
    g = kda_gate(x.f.unflatten(-1, heads), params.dt_bias, params.a_log, params.lower_bound)
    o, final = kda_chunked(qq, kk, vv, pad(g), pad(torch.sigmoid(x.b)), state_pool[slot_ids])
    state_pool[slot_ids] = final
    return torch.nn.functional.pad(o[valid], (0, 0, 0, 0, 0, x.q.shape[0] - cu_seqlens_cpu[-1]))


def _prefill_in_segments(
    x: KDAInputs, params: KDAParams, slots: KDASlots, cu_cpu: list[int], snapshots: ChunkSnapshots
) -> torch.Tensor:
    """`prefill` with `snapshots`: every sequence cut at its snapshot chunks' ends, segment by segment,
    the slot's window and state copied into the snapshot after each cut."""
    ids = snapshots.chunk_ids.tolist()
    conv_pool, state_pool, slot_ids = slots.tensors
    o = x.q.new_zeros(x.q.shape[0], *state_pool.shape[1:3])
    first_chunk = 0
    for i, (lo, hi) in enumerate(itertools.pairwise(cu_cpu)):
        chunks = -(-(hi - lo) // CHUNK_TOKENS)
        cuts = {
            (c + 1) * CHUNK_TOKENS: ids[first_chunk + c]
            for c in range(chunks - 1)
            if ids[first_chunk + c] >= 0
        }
        bounds = [0, *sorted(cuts), hi - lo]
        slot = slot_ids[i : i + 1]
        for start, stop in itertools.pairwise(bounds):
            part = slice(lo + start, lo + stop)
            o[part] = prefill(
                x.rows(part), params, KDASlots(conv_pool, state_pool, slot), None, [0, stop - start]
            )
            if stop in cuts:
                snapshots.conv[cuts[stop]] = conv_pool[slot[0]]
                snapshots.state[cuts[stop]] = state_pool[slot[0]]
        first_chunk += chunks
    return o


def decode(x: KDAInputs, params: KDAParams, slots: KDASlots, norm: OutputNorm | None = None) -> torch.Tensor:
    """One token per sequence (`[B, ...]` inputs; f, b and the norm's gate may be `LowRank`), state and
    window updated in place; o `[B, H, d]`, then `gated_rms_norm` with `norm` when given."""
    x = KDAInputs(x.q, x.k, x.v, dense(x.f), dense(x.b))
    o = prefill(x, params, slots, None, list(range(x.q.shape[0] + 1)))
    if norm is None:
        return o
    return gated_rms_norm(o, dense(norm.gate).reshape(o.shape), norm.weight, norm.eps)


def verify(
    x: KDAInputs, params: KDAParams, slots: KDASlots, step_states: torch.Tensor | None = None
) -> tuple[torch.Tensor, VerifyCache]:
    """T = k+1 tokens per sequence (`[B, T, ...]` inputs): outputs for every position from the committed
    window and state, which stay untouched. With `step_states [B, T, H, d, d]` (fp32) the state after
    each step is written there too. Returns o `[B, T, H, d]` and the cache `commit` replays from."""
    conv_pool, state_pool, slot_ids = slots.tensors
    bsz, t = x.q.shape[:2]
    heads = tuple(state_pool.shape[1:3])
    full = torch.full((bsz,), t, device=x.q.device)
    y, _ = causal_conv(torch.cat([x.q, x.k, x.v], -1), conv_pool[slot_ids], params.conv_weight, full)
    qq, kk, vv = (part.unflatten(-1, heads) for part in y.chunk(3, dim=-1))
    g = kda_gate(x.f.unflatten(-1, heads), params.dt_bias, params.a_log, params.lower_bound)
    beta = torch.sigmoid(x.b)
    o, _ = kda_chunked(qq, kk, vv, g, beta, state_pool[slot_ids])
    if step_states is not None:
        for n in range(1, t + 1):
            _, s = kda_chunked(qq[:, :n], kk[:, :n], vv[:, :n], g[:, :n], beta[:, :n], state_pool[slot_ids])
            step_states[:, n - 1] = s
    return o, VerifyCache(x)


def commit(cache: VerifyCache, params: KDAParams, slots: KDASlots, n_accepted: torch.Tensor) -> None:
    """Advance each sequence's window and state by its first `n_accepted[b]` verified tokens (0..T)."""
    keep = n_accepted.tolist()
    rows = [i for i, n in enumerate(keep) if n > 0]
    if not rows:
        return
    accepted = KDAInputs(*(torch.cat([t[i, : keep[i]] for i in rows]) for t in cache.x.tensors))
    cu = [0]
    for i in rows:
        cu.append(cu[-1] + keep[i])
    prefill(accepted, params, KDASlots(slots.conv_pool, slots.state_pool, slots.slot_ids[rows]), None, cu)


def commit_steps(
    cache: VerifyCache, step_states: torch.Tensor, slots: KDASlots, n_accepted: torch.Tensor
) -> None:
    """The per-step-state alternative: copy the state saved after step n_accepted[b] into the slot."""
    conv_pool, state_pool, slot_ids = slots.tensors
    x = cache.x
    for i, n in enumerate(n_accepted.tolist()):
        if n > 0:
            state_pool[slot_ids[i]] = step_states[i, n - 1]
            z = torch.cat([conv_pool[slot_ids[i]], torch.cat([x.q, x.k, x.v], -1)[i, :n]])
            conv_pool[slot_ids[i]] = z[-conv_pool.shape[1] :]
