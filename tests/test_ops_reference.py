"""The torch reference ops against direct, per-step/per-query formulations of the same math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo.ops.indexer import PooledKeys, compress_pools, select_rows
from hylo.ops.kda import causal_conv, kda_chunked, kda_gate
from hylo.ops.mhc import HCParams, mhc_pre
from hylo.ops.moe import Choices, ExpertWeights, Routing, experts, route, swiglu_clamp


def naive_kda(q, k, v, g, beta, state):
    """One step at a time, as FLA's naive recurrent KDA writes it."""
    q = F.normalize(q.float(), dim=-1, eps=0) * q.shape[-1] ** -0.5
    k = F.normalize(k.float(), dim=-1, eps=0)
    s = state.clone()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t, :, :, None].exp()
        s = s + torch.einsum(
            "bhk,bhv->bhkv",
            beta[:, t, :, None] * k[:, t],
            v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s),
        )
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, 1), s


def kda_inputs(b=2, t=45, h=3, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = kda_gate(
        torch.randn(b, t, h, d, generator=gen),
        torch.randn(h * d, generator=gen),
        torch.randn(h, generator=gen),
        -5.0,
    )
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, d, d, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_kda_chunked_matches_recurrence(chunk):
    q, k, v, g, beta, state = kda_inputs()
    o, s = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    o_ref, s_ref = naive_kda(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


def test_kda_state_carries_across_calls_and_padding_is_inert():
    q, k, v, g, beta, state = kda_inputs()
    o_all, s_all = kda_chunked(q, k, v, g, beta, state)
    o1, s1 = kda_chunked(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], state)
    o2, s2 = kda_chunked(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-5)
    g_pad, beta_pad = g.clone(), beta.clone()
    g_pad[:, 30:], beta_pad[:, 30:] = 0, 0
    _, s_pad = kda_chunked(q, k, v, g_pad, beta_pad, state)
    _, s_30 = kda_chunked(q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30], state)
    torch.testing.assert_close(s_pad, s_30, rtol=1e-5, atol=1e-6)


def test_kda_safe_gate_bounds():
    """The safe gate lb·σ(e^A·(f + b)) stays within [lb, 0] and reaches both ends where |f| is large (the
    inputs seeded: unseeded, a draw could miss the ends by chance)."""
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(5, 2, 4, generator=gen) * 10
    f[0, :, 0], f[0, :, 1] = 1e3, -1e3  # far past any bias: σ saturates
    g = kda_gate(f, torch.randn(8, generator=gen), torch.randn(2, generator=gen), -5.0)
    assert bool(((g >= -5) & (g <= 0)).all())
    torch.testing.assert_close(g[0, :, 0], torch.full((2,), -5.0))
    torch.testing.assert_close(g[0, :, 1], torch.zeros(2), rtol=0, atol=1e-6)


def test_causal_conv_matches_conv1d_and_carries_window():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    ref = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None, :], padding=3, groups=6)[..., :11]).transpose(
        1, 2
    )
    empty = torch.zeros(2, 3, 6)
    y, _ = causal_conv(x, empty, weight, torch.tensor([11, 11]))
    torch.testing.assert_close(y, ref)
    y1, window = causal_conv(x[:, :7], empty, weight, torch.tensor([7, 5]))
    torch.testing.assert_close(window[0], x[0, 4:7])
    torch.testing.assert_close(window[1], x[1, 2:5])
    y2, _ = causal_conv(x[:1, 7:], window[:1], weight, torch.tensor([4]))
    torch.testing.assert_close(torch.cat([y1[:1], y2], 1), ref[:1])


def brute_force_rows(q, w, pooled_keys, pos, kpool, topk):
    """Rows for one query, the plain way: score visible pools, keep the best (earlier pool on ties)."""
    visible = (pos + 1) // kpool
    scores = [(w * torch.relu(q @ pooled_keys[p])).sum().item() for p in range(visible)]
    best = sorted(range(visible), key=lambda p: (-scores[p], p))[: topk // kpool]
    rows = {p * kpool + i for p in best for i in range(kpool)}
    return rows | set(range(visible * kpool, pos + 1))


def test_select_rows_matches_brute_force_and_drops_tokens():
    gen = torch.Generator().manual_seed(2)
    kpool, topk, heads, d, length = 4, 8, 3, 5, 30
    keys, gates = torch.randn(length + 2, d, generator=gen), torch.randn(length + 2, d, generator=gen)
    ape = torch.randn(kpool, d, generator=gen)
    pooled = torch.zeros((length + 2) // kpool, d)
    compress_pools(keys, gates, ape, torch.arange(length // kpool), PooledKeys(pooled))
    members = torch.arange(kpool)
    for p in range(length // kpool):
        weights = torch.softmax(gates[p * kpool + members] + ape, dim=0)
        torch.testing.assert_close(pooled[p], (weights * keys[p * kpool + members]).sum(0))

    positions = torch.arange(length)[None]
    q = torch.randn(1, length, heads, d, generator=gen)
    w = torch.randn(1, length, heads, generator=gen)
    table = torch.arange(length // kpool)[None]
    rows = select_rows(q, w, pooled, table, positions, kpool, topk, tail=True)
    assert rows.shape == (1, length, topk + kpool - 1)
    dropped = 0
    for t in range(length):
        got = [r for r in rows[0, t].tolist() if r >= 0]
        assert len(got) == len(set(got))
        expect = brute_force_rows(q[0, t], w[0, t], pooled, t, kpool, topk)
        assert set(got) == expect
        dropped += len(expect) < t + 1
    assert dropped > length // 2


def test_mhc_comb_is_doubly_stochastic():
    gen = torch.Generator().manual_seed(3)
    n, dim = 4, 8
    streams = torch.randn(5, n, dim, generator=gen)
    post, comb, collapsed = mhc_pre(
        streams,
        HCParams(
            0.1 * torch.randn(24, n * dim, generator=gen),
            torch.randn(24, generator=gen),
            torch.rand(3, generator=gen) + 0.5,
            1e-5,
            1e-6,
            20,
        ),
    )
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, n), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, n), atol=1e-3, rtol=0)
    assert bool(((post > 0) & (post < 2)).all()) and collapsed.shape == (5, dim)


def test_routing_and_experts_match_per_token_loop():
    gen = torch.Generator().manual_seed(4)
    tokens, dim, n_exp, inter, top_k, n_group, topk_group = 9, 6, 8, 5, 3, 4, 2
    x = torch.randn(tokens, dim, generator=gen)
    router, bias = torch.randn(n_exp, dim, generator=gen), torch.randn(n_exp, generator=gen) * 0.3
    ids, weights = route(x, Routing(router, bias, top_k, n_group, topk_group, True, 2.5))
    gate_up = torch.randn(n_exp, 2 * inter, dim, generator=gen)
    down = torch.randn(n_exp, dim, inter, generator=gen)
    out = experts(x, ExpertWeights(gate_up, down), Choices(ids, weights), limit=1.5)
    for t in range(tokens):
        scores = torch.sigmoid(router @ x[t])
        biased = scores + bias
        group_strength = biased.view(n_group, -1).topk(2).values.sum(-1)
        groups = set(group_strength.topk(topk_group).indices.tolist())
        allowed = [e for e in range(n_exp) if e // (n_exp // n_group) in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:top_k]
        assert set(ids[t].tolist()) == set(chosen)
        w = scores[chosen] / scores[chosen].sum() * 2.5
        expect = sum(
            wi * down[e] @ swiglu_clamp(*(gate_up[e] @ x[t]).chunk(2), 1.5)
            for wi, e in zip(w, chosen, strict=True)
        )
        torch.testing.assert_close(out[t], expect, rtol=1e-4, atol=1e-5)
