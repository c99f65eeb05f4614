"""Triton sparse-MLA and indexer kernels against the torch references.

Without a GPU the kernels run under TRITON_INTERPRET=1 at small shapes on fp32 tiles (the
interpreter's bf16 `tl.dot` is wrong, DESIGN §8); FP8 kernels and real shapes run on a GPU
(the `cuda` tests; `benchmarks/kernels/sparse.py` repeats them before timing).
"""

from __future__ import annotations

import pytest
import torch
from interpreter import use_interpreter

CUDA = torch.cuda.is_available()
if not CUDA:
    use_interpreter()  # before the kernels are decorated

from hylo.ops import indexer as indexer_ops  # noqa: E402
from hylo.ops import sparse_mla as sparse_mla_ops  # noqa: E402
from hylo.ops.indexer import kernels as ik  # noqa: E402
from hylo.ops.indexer import reference as iref  # noqa: E402
from hylo.ops.sparse_mla import kernels as sk  # noqa: E402
from hylo.ops.sparse_mla.reference import sparse_mla  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

DEV = "cuda" if CUDA else "cpu"
# fp32 tiles: exact under the interpreter, tf32 tensor-core dots on the GPU
TOL = {"rtol": 5e-3, "atol": 5e-3} if CUDA else {"rtol": 1e-4, "atol": 1e-5}
cuda_only = pytest.mark.skipif(not CUDA, reason="FP8 and real-shape kernels run on the GPU")


def bundled(q, w, pooled, scale, pool_table, req_to_token, token_seq, token_rows, *rest):
    """`select_slots`' arguments (q, w and the typed bundles) from a case's tensors and choices."""
    positions, pad_index, pad_valid, kpool, topk, tail = rest
    layout = indexer_ops.SlotLayout(
        pool_table, req_to_token, token_seq, token_rows, positions, pad_index, pad_valid
    )
    return q, w, indexer_ops.PooledKeys(pooled, scale), layout, indexer_ops.Selection(kpool, topk, tail)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- sparse MLA


def mla_case(tokens, heads, rank, slots, width, seed, dtype=torch.float32):
    g = gen(seed)
    q = torch.randn(tokens, heads, rank, generator=g)
    latent = torch.randn(slots, rank, generator=g)
    rows = torch.randint(0, slots, (tokens, width), generator=g)
    rows[torch.rand(tokens, width, generator=g) < 0.3] = -1
    rows[0] = -1
    rows[0, width - 1] = 7  # one valid row, in the last chunk only: all other chunks are empty
    if tokens > 1:
        rows[1, : width // 2] = -1  # a run of empty chunks
    return q.to(DEV, dtype), latent.to(DEV, dtype), rows.to(DEV)


@pytest.mark.parametrize(
    ("kwargs", "row_dtypes"),
    [
        ({"num_splits": 1}, (torch.int32, torch.int64)),  # prefill: one pass per token
        ({"num_splits": 3, "block_n": 16}, (torch.int32,)),  # decode: chunks merged by log-sum-exp
        ({}, (torch.int32,)),  # automatic split
    ],
)
def test_sparse_mla_kernel_matches_reference(kwargs, row_dtypes):
    """int32 rows as the indexer selects them; int64 rows (another specialisation of the same loads, which
    the merge never reads) in one case."""
    q, latent, rows, scale = *mla_case(3, 20, 32, 200, 70, seed=1), 32**-0.5
    ref = sparse_mla(q.double(), latent.double(), rows, scale)
    for r in (rows.to(dtype) for dtype in row_dtypes):
        out = sk.sparse_mla_fwd(q, latent, r, scale, block_h=16, **kwargs)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.double(), ref, **TOL)


def test_sparse_mla_prefill_stops_at_each_tokens_last_row():
    """A prefill program walks its list only up to its token's last valid row: lists that end at,
    just past and inside a block, and a scattered one, give the reference's outputs."""
    q, latent, rows, scale = *mla_case(5, 16, 32, 200, 70, seed=4), 32**-0.5
    rows[:4] = -1
    rows[0, :16] = torch.arange(16)  # ends at a block boundary (block_n 16)
    rows[1, :17] = torch.arange(20, 37)  # one row into the next block
    rows[2, :40] = torch.arange(50, 90)  # inside a block
    rows[3, 3], rows[3, 33] = 5, 9  # scattered, the last in the third block
    ref = sparse_mla(q.double(), latent.double(), rows, scale)
    out = sk.sparse_mla_fwd(q, latent, rows, scale, block_h=16, block_n=16, num_splits=1)
    torch.testing.assert_close(out.double(), ref, **TOL)


def test_sparse_mla_decode_fp16_and_dispatch():
    q, latent, rows = mla_case(2, 16, 64, 300, 130, seed=2, dtype=torch.float16)
    ref = sparse_mla(q.double(), latent.double(), rows, 0.125)
    out = sk.sparse_mla_decode(q, latent, rows, 0.125, num_splits=4, block_n=32)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    # the dispatcher sends CPU tensors to the reference and CUDA tensors to the kernel
    torch.testing.assert_close(
        sparse_mla_ops.sparse_mla(q.float(), latent.float(), rows, 0.125).double(), ref, rtol=5e-3, atol=5e-3
    )


# ---------------------------------------------------------------- indexer


@pytest.mark.parametrize("kpool", [4, 3])  # 3: the pool's tile padded to a power of two
def test_compress_pools_kernel_matches_reference(kpool):
    g = gen(3)
    d, slots = 32, 96
    keys, gates = torch.randn(slots, d, generator=g), torch.randn(slots, d, generator=g) * 3
    ape = torch.randn(kpool, d, generator=g)
    pools = torch.tensor([0, 5, 2, 23, 9], dtype=torch.long)
    expect, got = torch.full((slots // kpool, d), 7.0), torch.full((slots // kpool, d), 7.0)
    iref.compress_pools(keys, gates, ape, pools, expect)
    ik.compress_pools(keys.to(DEV), gates.to(DEV), ape.to(DEV), pools.to(DEV), got := got.to(DEV))
    torch.testing.assert_close(got.cpu(), expect, rtol=1e-5, atol=1e-5)  # untouched pools stay 7


def packed_batch(lengths, prefixes, kpool, slots_per_seq, seed):
    """A ForwardBatch-like layout: sequences in request-table rows 2b+1, pools at aligned slots."""
    g = gen(seed)
    batch = len(lengths)
    totals = [p + n for p, n in zip(prefixes, lengths, strict=True)]
    max_len = max(totals)
    req_to_token = torch.full((2 * batch + 1, max_len), -1, dtype=torch.int32)
    for b, total in enumerate(totals):
        pages = torch.randperm(slots_per_seq * batch // kpool, generator=g)[: (total + kpool - 1) // kpool]
        req_to_token[2 * b + 1, :total] = (
            (pages[:, None] * kpool + torch.arange(kpool)).flatten()[:total].int()
        )
    token_seq = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lengths, strict=True)])
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    steps = torch.arange(max(lengths))
    pad_valid = steps[None] < torch.tensor(lengths)[:, None]
    pad_index = torch.where(pad_valid, starts[:, None] + steps[None], 0)
    max_pools = max(t // kpool for t in totals)
    table_rows = 2 * torch.arange(batch) + 1
    pool_table = req_to_token[table_rows][:, : max_pools * kpool : kpool].long() // kpool
    pool_table = torch.where(
        torch.arange(max_pools)[None] < torch.tensor(totals)[:, None] // kpool, pool_table, -1
    )
    return {
        "pool_table": pool_table,
        "req_to_token": req_to_token,
        "token_seq": token_seq,
        "token_rows": table_rows[token_seq],
        "positions": positions,
        "pad_index": pad_index,
        "pad_valid": pad_valid,
    }


def indexer_case(lengths, prefixes, kpool, heads, d, seed, integer=False):
    per_seq = 2 * max(p + n for p, n in zip(prefixes, lengths, strict=True))
    meta = packed_batch(lengths, prefixes, kpool, per_seq, seed)
    g = gen(seed + 1)
    tokens, n_pools = len(meta["positions"]), per_seq * len(lengths) // kpool
    if integer:  # small integers: every score is exact in any summation order, and ties are common
        q = torch.randint(-2, 3, (tokens, heads, d), generator=g).float()
        w = torch.randint(-1, 3, (tokens, heads), generator=g).float()
        pooled = torch.randint(-2, 3, (n_pools, d), generator=g).float()
    else:
        q = torch.randn(tokens, heads, d, generator=g) * d**-0.5
        w = torch.randn(tokens, heads, generator=g) * heads**-0.5
        pooled = torch.randn(n_pools, d, generator=g)
    return q, w, pooled, meta


def to_dev(meta):
    return {k: v.to(DEV) for k, v in meta.items()}


def ref_scores(q, w, pooled, meta, kpool):
    """Dense [T, P] scores with -inf where the pool is not visible, computed per token."""
    keys = pooled[meta["pool_table"].clamp(min=0)]  # [B, P, d]
    out = torch.full((len(q), keys.shape[1]), float("-inf"), dtype=torch.float64)
    for t in range(len(q)):
        vis = (int(meta["positions"][t]) + 1) // kpool
        k = keys[meta["token_seq"][t], :vis].double()
        out[t, :vis] = (torch.relu(q[t].double() @ k.T) * w[t, :, None].double()).sum(0)
    return out


@pytest.mark.parametrize("pools_major", [False, True])
def test_index_scores_kernel_matches_reference(pools_major):
    kpool, heads, d = 4, 4, 16
    q, w, pooled, meta = indexer_case([9, 1, 30], [40, 77, 3], kpool, heads, d, seed=4)
    got = ik.index_scores(
        q.to(DEV), w.to(DEV), pooled.to(DEV), None, *[to_dev(meta)[k] for k in
        ("pool_table", "positions", "pad_index", "pad_valid")], kpool,
        block_t=8, block_p=16, pools_major=pools_major,
    )  # fmt: skip
    expect = ref_scores(q, w, pooled, meta, kpool)
    seen = expect > float("-inf")
    torch.testing.assert_close(got.cpu().double()[seen], expect[seen], **TOL)


def test_index_scores_refuse_a_validity_mask_of_another_layout():
    """The score kernel steps `pad_valid` by `pad_index`'s strides: a mask laid out otherwise is refused by
    name (it would be read at the wrong steps), one of the same layout taken."""
    kpool, heads, d = 4, 4, 16
    q, w, pooled, meta = indexer_case([9, 1, 30], [40, 77, 3], kpool, heads, d, seed=4)
    meta = to_dev(meta)
    pad_index, pad_valid = meta["pad_index"], meta["pad_valid"]
    args = (q.to(DEV), w.to(DEV), pooled.to(DEV), None, meta["pool_table"], meta["positions"])
    rows, steps = pad_valid.shape
    wide = torch.zeros(rows, steps + 5, dtype=pad_valid.dtype, device=DEV)[:, :steps]
    wide.copy_(pad_valid)
    with pytest.raises(ValueError, match="valid's row stride"):
        ik.index_scores(*args, pad_index, wide, kpool, block_t=8, block_p=16)
    with pytest.raises(ValueError, match="valid needs a unit stride"):
        ik.index_scores(*args, pad_index, pad_valid.t().contiguous().t(), kpool, block_t=8, block_p=16)
    ik.index_scores(*args, pad_index, wide.contiguous(), kpool, block_t=8, block_p=16)


def as_sets(rows):
    return [frozenset(r for r in row.tolist() if r >= 0) for row in rows]


# one register tile, or (max_tile 32) tile by tile
@pytest.mark.parametrize(("kpool", "max_tile"), [(4, ik.MAX_TOPK_TILE), (16, ik.MAX_TOPK_TILE), (4, 32)])
def test_topk_kernel_selects_reference_rows(kpool, max_tile, monkeypatch):
    """Integer inputs make scores exact, so ties (ReLU'd zeros and equal sums) hit the tie rule."""
    monkeypatch.setattr(ik, "MAX_TOPK_TILE", max_tile)
    topk, heads, d = 8 * kpool, 4, 16
    # One program per token, each a 16-pass search (a take-all token, the second sequence's, skips it): the
    # third sequence holds every position in a pool (the tail's lengths) and pools becoming visible as it
    # goes, 17 tokens for pools of 16, 9 for pools of 4 (two pools completed). The tiled search passes over
    # every tile of the visible pools, slower still to interpret: one token over three tiles of 32 (75
    # visible pools, the last tile partial), four over two (50 and 51 pools, every tail length).
    lengths = ([5, 2, 17] if kpool == 16 else [5, 2, 9]) if max_tile > 32 else [1, 1, 4]
    q, w, pooled, meta = indexer_case(lengths, [300, 20, 200], kpool, heads, d, seed=5 + kpool, integer=True)
    args = (
        q,
        w,
        pooled,
        None,
        meta["pool_table"],
        meta["req_to_token"],
        meta["token_seq"],
        meta["token_rows"],
    )
    rest = (meta["positions"], meta["pad_index"], meta["pad_valid"], kpool, topk, True)
    expect = iref.select_slots(*bundled(*args, *rest))
    dev = (*[a.to(DEV) if a is not None else None for a in args], *[a.to(DEV) for a in rest[:3]], *rest[3:])
    got = ik.select_slots(*bundled(*dev)).cpu()
    assert (
        got.dtype == torch.int32
        and got.shape[1] == ik.row_width(topk, kpool, True)
        and got.shape[1] % 64 == 0
    )
    assert as_sets(got) == as_sets(expect)
    for row in got:  # compact: valid slots first, each once
        n = int((row >= 0).sum())
        assert bool((row[:n] >= 0).all()) and len(set(row[:n].tolist())) == n
    ties = sum(len(set(s.tolist())) < len(s) for s in ref_scores(q, w, pooled, meta, kpool))
    assert ties > 0  # the case really has tied scores


def test_select_slots_for_a_token_range():
    """A rank's share of a step split by token: the range's rows equal the whole step's, from the
    kernels (which score and rank the range alone, across a sequence boundary) and the reference
    dispatch; a rank holding padding alone gets no row."""
    kpool, topk = 4, 16
    q, w, pooled, meta = indexer_case([3, 2, 4], [30, 20, 12], kpool, 4, 16, seed=9, integer=True)
    args = (q, w, pooled, None, *[meta[k] for k in ("pool_table", "req_to_token", "token_seq", "token_rows")])
    rest = (meta["positions"], meta["pad_index"], meta["pad_valid"], kpool, topk, True)
    whole = as_sets(iref.select_slots(*bundled(*args, *rest)))
    dev = (*[a.to(DEV) if a is not None else None for a in args], *[a.to(DEV) for a in rest[:3]], *rest[3:])
    for tokens in (range(2, 6), range(6, 9), range(9, 9)):
        got = ik.select_slots(*bundled(*dev), tokens).cpu()
        assert got.shape[0] == len(tokens) and as_sets(got) == whole[tokens.start : tokens.stop]
        assert as_sets(indexer_ops.select_slots(*bundled(*args, *rest), tokens)) == as_sets(got)


def test_topk_kernel_without_tail_and_short_sequences():
    kpool, topk = 4, 16
    q, w, pooled, meta = indexer_case([6, 3], [0, 1], kpool, 4, 16, seed=6)
    args = (
        q,
        w,
        pooled,
        None,
        meta["pool_table"],
        meta["req_to_token"],
        meta["token_seq"],
        meta["token_rows"],
    )
    rest = (meta["positions"], meta["pad_index"], meta["pad_valid"], kpool, topk, False)
    expect = iref.select_slots(*bundled(*args, *rest))
    got = indexer_ops.select_slots(*bundled(*args, *rest))  # CPU dispatch: the reference itself
    assert as_sets(got) == as_sets(expect)
    dev = (*[a.to(DEV) if a is not None else None for a in args], *[a.to(DEV) for a in rest[:3]], *rest[3:])
    got = ik.select_slots(*bundled(*dev)).cpu()
    assert as_sets(got) == as_sets(expect)
    assert as_sets(got)[0] == frozenset()  # position 0 without a tail attends to nothing


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at the reference's magnitude."""
    spacing = torch.finfo(ref.dtype).eps * ref.abs().double().clamp_min(torch.finfo(ref.dtype).tiny)
    return float(((out.double() - ref.double()).abs() / spacing).max())


def store_case(dtype, seed, tokens=5, d=32, slots=40):
    """Keys and gate scores as column views of one wider projection, a key norm, caches of `slots`
    rows holding other tokens' rows, and distinct slots to write."""
    g = gen(seed)
    product = (torch.randn(tokens, 3 * d + 8, generator=g) * 4 + 1).to(dtype)
    key, gate_scores = product[:, 8 : 8 + d], product[:, 8 + 2 * d :]
    norm = indexer_ops.KeyNorm(
        (torch.randn(d, generator=g) * 0.5 + 1).to(dtype), (torch.randn(d, generator=g) * 0.1).to(dtype), 1e-6
    )
    cache = indexer_ops.TokenKeys(*(torch.randn(2, slots, d, generator=g).to(dtype)))
    new_slots = torch.randperm(slots, generator=g)[:tokens]
    return key, gate_scores, norm, cache, new_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_tokens_kernel_matches_reference(dtype):
    """The LayerNorm statistics are fp32 sums in another order: they move the fp32 output by a few ulps
    of the row's scale (d of them at most, the mean's cancellation), which the rounding to a 16-bit
    dtype turns into at most one of its ulps. Gate scores are copied bit for bit; other rows untouched."""
    key, gate_scores, norm, cache, slots = store_case(dtype, seed=11)
    expect = indexer_ops.TokenKeys(cache.keys.clone(), cache.gates.clone())
    iref.store_tokens(key, gate_scores, norm, expect, slots)
    assert indexer_ops.store_refusal(key, gate_scores, norm, cache, slots) is None
    dev = lambda t: t.to(DEV)  # noqa: E731
    got = indexer_ops.TokenKeys(dev(cache.keys.clone()), dev(cache.gates.clone()))
    norm_dev = indexer_ops.KeyNorm(dev(norm.weight), dev(norm.bias), norm.eps)
    ik.store_tokens(dev(key), dev(gate_scores), norm_dev, got, dev(slots.int()))
    assert torch.equal(got.gates.cpu(), expect.gates)
    untouched = torch.ones(len(cache.keys), dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got.keys.cpu()[untouched], expect.keys[untouched])
    new, ref = got.keys.cpu()[slots], expect.keys[slots]
    if dtype == torch.float32:
        torch.testing.assert_close(new, ref, rtol=0, atol=key.shape[1] * 1.2e-7 * float(ref.abs().max()))
    else:
        assert ulps(new, ref) <= 1, dtype
    assert not torch.equal(ref, cache.keys[slots])  # the case really writes new rows


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda c: {**c, "key": c["key"][:, :24]}, "[T, d] alike"),
        (lambda c: {**c, "key": c["key"][:, :24], "gate_scores": c["gate_scores"][:, :24]}, "power-of-two"),
        (
            lambda c: {**c, "cache": indexer_ops.TokenKeys(c["cache"].keys[:, :16], c["cache"].gates)},
            "[S, 32]",
        ),
        (lambda c: {**c, "key": c["key"].t().contiguous().t()}, "unit last stride"),
        (
            lambda c: {**c, "norm": indexer_ops.KeyNorm(c["norm"].weight[:16], c["norm"].bias, 1e-6)},
            "[32] vec",
        ),
        (lambda c: {**c, "slots": c["slots"].float()}, "int32 or int64"),
    ],
)
def test_store_refusal_names_why(change, reason):
    key, gate_scores, norm, cache, slots = store_case(torch.float32, seed=12)
    call = change({"key": key, "gate_scores": gate_scores, "norm": norm, "cache": cache, "slots": slots})
    assert reason in indexer_ops.store_refusal(**call)


# ---------------------------------------------------------------- FP8 (reference on the CPU)


def test_fp8_row_scale_is_the_smallest_power_of_two():
    amax = torch.tensor([0.0, 448.0, 448.1, 1.0, 3e-3, 1e4])
    scale = iref.fp8_row_scale(amax)
    torch.testing.assert_close(scale, torch.tensor([1.0, 1.0, 2.0, 2.0**-8, 2.0**-17, 32.0]))
    x = torch.randn(50, 128, generator=gen(7)) * torch.logspace(-3, 3, 50)[:, None]
    x_q, s = iref.quantize_fp8_rows(x)
    assert bool((x_q.float().abs().amax(-1) <= 448).all()) and bool((x_q.float().abs().amax(-1) >= 224).all())
    assert float(((x_q.float() * s[:, None] - x).abs() / x.abs().amax(-1, keepdim=True)).max()) < 1 / 16


def realistic_indexer(tokens, pools, heads=32, d=128, seed=8, device="cpu"):
    """Keys like LayerNorm'd projections pooled by softmax; queries share a few directions with the
    keys so that some pools score far above the rest, as trained indexers do."""
    g = gen(seed)
    topics = torch.randn(16, d, generator=g)
    mix = torch.randn(pools, 16, generator=g).softmax(-1) * 3
    keys = torch.nn.functional.layer_norm(mix @ topics + torch.randn(pools, d, generator=g), (d,))
    q = (
        torch.randn(tokens, heads, 16, generator=g) @ topics + torch.randn(tokens, heads, d, generator=g)
    ) * d**-0.5
    w = torch.randn(tokens, heads, generator=g) * heads**-0.5
    return q.to(device), w.to(device), keys.to(device)


def fp8_overlap(q, w, keys, k_pools):
    """Share of the bf16 top-k pools that FP8 scoring also selects, averaged over queries."""
    bf = torch.relu(q.bfloat16().float() @ keys.bfloat16().float().T)  # [T, H, P]
    k_q, k_s = iref.quantize_fp8_rows(keys.bfloat16())
    q_q, q_s = iref.quantize_fp8_rows(q.bfloat16())
    f8 = torch.relu((q_q.float() * q_s[..., None]) @ (k_q.float() * k_s[:, None]).T)
    top_bf = (w[..., None] * bf).sum(1).topk(k_pools).indices
    top_f8 = (w[..., None] * f8).sum(1).topk(k_pools).indices
    hits = (top_bf[:, :, None] == top_f8[:, None, :]).any(-1).float()
    return float(hits.mean())


def test_fp8_scoring_keeps_the_bf16_selection():
    q, w, keys = realistic_indexer(48, 3328)
    overlap = fp8_overlap(q, w, keys, 512)
    assert overlap >= 0.97, overlap


def test_fp8_reference_path_runs_through_the_cache_layout():
    g = gen(9)
    kpool, d, slots = 4, 32, 64
    keys, gates, ape = (
        torch.randn(slots, d, generator=g),
        torch.randn(slots, d, generator=g),
        torch.zeros(kpool, d),
    )
    pooled = torch.zeros(slots // kpool, d, dtype=torch.float8_e4m3fn)
    scale = torch.ones(slots // kpool)
    indexer_ops.compress_pools(
        keys, gates, ape, torch.arange(slots // kpool), indexer_ops.PooledKeys(pooled, scale)
    )
    exact = torch.zeros(slots // kpool, d)
    iref.compress_pools(keys, gates, ape, torch.arange(slots // kpool), exact)
    err = (pooled.float() * scale[:, None] - exact).abs().amax(-1) / exact.abs().amax(-1)
    assert float(err.max()) < 1 / 16 and bool((scale.log2() == scale.log2().round()).all())


# ---------------------------------------------------------------- GPU: FP8 kernels and real shapes


@cuda_only
def test_cuda_sparse_mla_real_shapes():
    for tokens in (1, 8, 300):
        q, latent, rows = mla_case(tokens, 64, 512, 16384, 2112, seed=tokens, dtype=torch.bfloat16)
        ref = sparse_mla(q.float(), latent.float(), rows, 256**-0.5)
        out = sk.sparse_mla_fwd(q, latent, rows.int(), 256**-0.5)
        err = (out.float() - ref).norm() / ref.norm()
        assert err < 1e-2, (tokens, float(err))


@cuda_only
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_indexer_matches_reference(fp8):
    kpool, topk, heads, d = 4, 256, 32, 128
    q, w, pooled, meta = indexer_case([700, 1, 3], [100, 1500, 2000], kpool, heads, d, seed=10, integer=True)
    q, pooled = q / 4, pooled / 2  # still exact in fp8 with power-of-two scales
    scale = None
    if fp8:
        pooled, scale = iref.quantize_fp8_rows(pooled)
    else:
        q, pooled = q.bfloat16(), pooled.bfloat16()
    args = (
        q,
        w,
        pooled,
        scale,
        meta["pool_table"],
        meta["req_to_token"],
        meta["token_seq"],
        meta["token_rows"],
    )
    rest = (meta["positions"], meta["pad_index"], meta["pad_valid"], kpool, topk, True)
    expect = iref.select_slots(*bundled(*args, *rest))
    dev = (*[a.cuda() if a is not None else None for a in args], *[a.cuda() for a in rest[:3]], *rest[3:])
    got = indexer_ops.select_slots(*bundled(*dev)).cpu()
    assert as_sets(got) == as_sets(expect)


@cuda_only
def test_cuda_compress_pools_fp8():
    g = gen(11)
    keys = torch.randn(4096, 128, generator=g).bfloat16().cuda()
    gates = torch.randn(4096, 128, generator=g).bfloat16().cuda()
    ape = torch.randn(4, 128, generator=g).cuda()
    pools = torch.randperm(1024, generator=g)[:700].cuda()
    pooled, scale = (
        torch.zeros(1024, 128, dtype=torch.float8_e4m3fn, device="cuda"),
        torch.ones(1024, device="cuda"),
    )
    ik.compress_pools(keys, gates, ape, pools, pooled, scale)
    ref, ref_scale = torch.zeros_like(pooled), torch.ones_like(scale)
    iref.compress_pools(keys, gates, ape, pools, ref, ref_scale)
    # The kernel pools in fp32 and rounds once to bf16, the reference multiplies and sums in bf16: a
    # pool's amax can land on the other side of a power of two (a 2x scale), so compare dequantised.
    assert float((scale[pools] == ref_scale[pools]).float().mean()) > 0.9
    deq, deq_ref = (pooled.float() * scale[:, None])[pools], (ref.float() * ref_scale[:, None])[pools]
    assert float(((deq - deq_ref).abs().amax(-1) / deq_ref.abs().amax(-1)).max()) <= 0.125  # one step
    assert bool((pooled[pools].float().abs().amax(-1) >= 224).all())  # the scale uses the fp8 range
