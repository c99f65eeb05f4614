"""Torch reference of the KDA ops: causal conv with a carried window, safe gate, chunked delta rule,
sigmoid-gated RMSNorm. Sequences are right-padded `[B, T, ...]`; padded steps carry g = 0 and β = 0,
which leaves the state exactly unchanged, so one call serves prefill, chunked prefill and decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
