"""Sparse MLA and k-pool indexer kernels on the GPU: real-shape parity, then timings of hylo's
Triton kernels against the naive torch baseline, the memory floor and the matmul ceiling, all
measured in the same run.

    python benchmarks/kernels/sparse.py [--quick] [--out DIR]
    python benchmarks/kernels/sparse.py --dry-run   # CPU, Triton interpreter, tiny sizes, fake timers

Shapes follow GLM-5.3-Flash: 64 heads, latent 512, scale 256^-0.5, 2051 selected rows (512 pools
of 4 + a 3-token tail) padded to 2112; indexer 32 heads x 128, k-pool 4, top-2048. Prints a table
last and writes `sparse.json` to --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from interpreter import use_interpreter

    use_interpreter()

import triton  # noqa: E402
from harness import RESULTS, bench, bench_graph, rec, section  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.ops.indexer import kernels as ik  # noqa: E402
from hylo.ops.indexer import reference as iref  # noqa: E402
from hylo.ops.sparse_mla import kernels as sk  # noqa: E402
from hylo.ops.sparse_mla.reference import sparse_mla as sparse_mla_ref  # noqa: E402

HEADS, RANK, SCALE = 64, 512, 256**-0.5
KPOOL, TOPK, IDX_HEADS, IDX_DIM = 4, 2048, 32, 128
WIDTH = ik.row_width(TOPK, KPOOL, True)  # 2112
DEV = "cpu" if DRY else "cuda"
# real sizes; --dry-run shrinks them to check the script itself on the CPU
CONTEXT, PREFILL, INDEXER_TOKENS, LAYERS = (4096, 64, 2304, 2) if DRY else (16384, 13312, 13312, 32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------- ceilings


def ceilings() -> None:
    x = torch.randn(1 << (16 if DRY else 29), device=DEV, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    rec("copy_TBps", round(2 * x.numel() * 2 / (t * 1e-6) / 1e12, 2))
    a = torch.randn(256 if DRY else 8192, 256 if DRY else 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t = bench(lambda: a @ b)
    rec("bf16_matmul_TFLOPs", round(2 * a.shape[0] ** 3 / (t * 1e-6) / 1e12, 1))


# ---------------------------------------------------------------- sparse MLA


def mla_rows(tokens: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """Per token: 512 random complete pools of the context (2048 slots) + a 3-slot tail, -1 padding."""
    n_pools = context // KPOOL
    rows = torch.full((tokens, WIDTH), -1, dtype=torch.int32)
    for t in range(tokens):
        pools = torch.randperm(n_pools - 1, generator=gen)[: TOPK // KPOOL]
        slots = (pools[:, None] * KPOOL + torch.arange(KPOOL)).flatten()
        rows[t, : TOPK + 3] = torch.cat([slots, (n_pools - 1) * KPOOL + torch.arange(3)]).int()
    return rows.to(DEV)


def mla_parity() -> None:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if DRY else torch.bfloat16  # the interpreter's bf16 dot is wrong
    latent = torch.randn(CONTEXT, RANK, device=DEV, dtype=dtype)
    for tokens in (1, 8, 16, 512) if not DRY else (1, 2):
        q = torch.randn(tokens, HEADS, RANK, device=DEV, dtype=dtype)
        rows = mla_rows(tokens, CONTEXT, gen)
        rows[0, 100:] = -1  # a token with mostly empty chunks
        ref = sparse_mla_ref(q.float(), latent.float(), rows.long(), SCALE)
        rec(
            f"parity_mla_T{tokens}_auto_relerr",
            round(rel_err(sk.sparse_mla_fwd(q, latent, rows, SCALE), ref), 5),
        )
        rec(
            f"parity_mla_T{tokens}_prefill_relerr",
            round(rel_err(sk.sparse_mla_prefill(q, latent, rows, SCALE), ref), 5),
        )


def mla_decode(quick: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    context, layers = CONTEXT, LAYERS  # rotate over 32 caches (512 MiB): the "cold" figure reads HBM, not L2
    latents = [torch.randn(context, RANK, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    configs = [
        dict(),  # default_config: (16 heads, 64 rows, 4 warps) up to 2 tokens, else (64, 64, 8 warps)
        dict(block_h=16, block_n=64, num_warps=4, num_stages=2),
        dict(block_h=64, block_n=64, num_warps=8, num_stages=2),
        dict(block_h=16, block_n=64, num_warps=4, num_stages=1, skip_empty=True),
    ]
    for tokens in (1, 2, 4, 8, 16, 64) if not DRY else (1,):
        q = torch.randn(tokens, HEADS, RANK, device=DEV, dtype=torch.bfloat16)
        rows = mla_rows(tokens, context, gen)
        floor_us = tokens * (TOPK + 3) * RANK * 2 / (RESULTS["copy_TBps"] * 1e12 / 2) * 1e6
        rec(f"decode_T{tokens}_floor_us", round(floor_us, 2))
        if tokens in (1, 8):

            def naive(q=q, rows=rows):
                sel = latents[0][rows.long().clamp(min=0)].float()
                s = torch.einsum("thl,tkl->thk", q.float(), sel) * SCALE
                s = s.masked_fill((rows < 0)[:, None, :], float("-inf"))
                return torch.einsum("thk,tkl->thl", s.softmax(-1), sel)

            rec(f"decode_T{tokens}_naive_torch_us", round(bench(naive), 1))
        sweep = configs if tokens in (1, 8) and not quick and not DRY else configs[:1]
        best = None
        for cfg in sweep:
            t = bench_graph(
                lambda cfg=cfg, q=q, rows=rows: sk.sparse_mla_decode(q, latents[0], rows, SCALE, **cfg)
            )
            rec(f"decode_T{tokens}_hylo_us[{cfg or 'default'}]", round(t, 2))
            best = t if best is None else min(best, t)
        rec(f"decode_T{tokens}_hylo_best_us", round(best, 2))

        def cold(q=q, rows=rows):
            for layer in range(layers):
                sk.sparse_mla_decode(q, latents[layer], rows, SCALE)

        rec(f"decode_T{tokens}_hylo_cold_us_per_layer", round(bench_graph(cold) / layers, 2))


def mla_decode_sweep(tokens_list: list[int]) -> None:
    """Launch-configuration sweep of the split-rows decode kernel (medians under graph replay)."""
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(CONTEXT, RANK, device=DEV, dtype=torch.bfloat16)
    deadline = time.time() + (5 if DRY else 270)
    grid = [
        (bh, bn, w, st)
        for bh in (32, 64)
        for bn in (32, 64)
        for w in (4, 8)
        for st in (2, 3, 4)
        if not (bn == 64 and st == 4)
    ]
    for tokens in tokens_list:
        q = torch.randn(tokens, HEADS, RANK, device=DEV, dtype=torch.bfloat16)
        rows = mla_rows(tokens, CONTEXT, gen)
        ref = sparse_mla_ref(q.float(), latent.float(), rows.long(), SCALE)
        timings = []
        for bh, bn, w, st in grid:
            for waves in (0.125, 0.25, 0.5, 1.0):
                if time.time() > deadline:
                    break
                cfg = dict(block_h=bh, block_n=bn, num_warps=w, num_stages=st, waves=waves)
                try:
                    err = rel_err(sk.sparse_mla_decode(q, latent, rows, SCALE, **cfg), ref)
                    if err > 1e-2:
                        rec(f"sweep_T{tokens}_{bh}_{bn}_{w}_{st}_{waves}_relerr", round(err, 4))
                        continue
                    t = bench_graph(
                        lambda cfg=cfg, q=q, rows=rows: sk.sparse_mla_decode(q, latent, rows, SCALE, **cfg)
                    )
                except Exception as exc:  # out of shared memory / registers: not a candidate
                    rec(f"sweep_T{tokens}_{bh}_{bn}_{w}_{st}_skipped", type(exc).__name__)
                    break
                timings.append((round(t, 2), bh, bn, w, st, waves))
        timings.sort()
        rec(f"sweep_T{tokens}_best10", timings[:10])


# `sparse_mla_prefill.cu`'s variants timed beside the default (its macros)
CUDA_VARIANTS = {
    "rescale every block": ("HYLO_SPARSE_MLA_RESCALE_SLACK=0.0f",),
    # bounds, not kernels (their outputs are wrong): the gather alone, the math alone on stale slots
    "probe: gather only": ("HYLO_SPARSE_MLA_PROBE=1",),
    "probe: math only": ("HYLO_SPARSE_MLA_PROBE=2",),
}


def mla_prefill(quick: bool, cuda_variants: list[str] | None = None) -> None:
    """The prefill kernels at PREFILL tokens; `cuda_variants`: the names of `CUDA_VARIANTS` to build and time
    beside the default (None: all)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    tokens = PREFILL
    dtype = torch.float32 if DRY else torch.bfloat16
    context = max(tokens, 2 * TOPK + 8)
    latent = torch.randn(context, RANK, device=DEV, dtype=dtype)
    q = torch.randn(tokens, HEADS, RANK, device=DEV, dtype=dtype)
    pools = torch.rand(tokens, context // KPOOL - 1, generator=gen, device=DEV).argsort(-1)[
        :, : TOPK // KPOOL
    ]
    rows = torch.full((tokens, WIDTH), -1, dtype=torch.int32, device=DEV)
    rows[:, :TOPK] = (pools[:, :, None] * KPOOL + torch.arange(KPOOL, device=DEV)).flatten(1).int()
    rows[:, TOPK : TOPK + 3] = (context - 4 + torch.arange(3, device=DEV)).int()
    del pools
    flops = 4 * tokens * HEADS * (TOPK + 3) * RANK
    sub = slice(0, 256)
    ref = sparse_mla_ref(q[sub].float(), latent.float(), rows[sub].long(), SCALE)
    # the dispatch's choice (the CUDA kernel where it runs), then the Triton kernel's tiles
    configs = [dict(), dict(cuda=False), dict(cuda=False, block_n=64, num_stages=1)]
    if not DRY:
        rec("prefill_cuda_refusal", str(sk.cuda_prefill.refusal(q, latent, rows)))
    calls = {str(cfg or "default"): lambda cfg=cfg: sk.sparse_mla_prefill(q, latent, rows, SCALE, **cfg)
             for cfg in (configs if not (quick or DRY) else configs[:2])}  # fmt: skip
    if not DRY and sk.cuda_prefill.refusal(q, latent, rows) is None:
        for name, defines in CUDA_VARIANTS.items():  # the CUDA kernel's compile-time variants
            if cuda_variants is not None and name not in cuda_variants:
                continue
            library = sk.cuda_prefill.load_library("sm_90a", defines)
            calls[f"cuda {name}"] = lambda lib=library: sk.cuda_prefill.prefill(
                q, latent, rows, SCALE, library=lib
            )
    for name, call in calls.items():
        out = call()
        err = rel_err(out[sub], ref)
        t = bench(call, rep=300)
        tflops = flops / (t * 1e-6) / 1e12
        rec(
            f"prefill_T{tokens}_hylo[{name}]",
            {
                "ms": round(t / 1e3, 3),
                "TFLOPs": round(tflops, 1),
                "pct_of_matmul": round(100 * tflops / RESULTS["bf16_matmul_TFLOPs"], 1),
                "relerr": round(err, 5),
            },
        )


# ---------------------------------------------------------------- indexer


def indexer_inputs(tokens: int, realistic: bool, gen: torch.Generator):
    n_pools = tokens // KPOOL
    if realistic:  # keys share a few directions with the queries: some pools far above the rest
        topics = torch.randn(16, IDX_DIM, generator=gen)
        mix = torch.randn(n_pools, 16, generator=gen).softmax(-1) * 3
        keys = torch.nn.functional.layer_norm(
            mix @ topics + torch.randn(n_pools, IDX_DIM, generator=gen), (IDX_DIM,)
        )
        q = torch.randn(tokens, IDX_HEADS, 16, generator=gen) @ topics
        q = (q + torch.randn(tokens, IDX_HEADS, IDX_DIM, generator=gen)) * IDX_DIM**-0.5
    else:
        keys = torch.randn(n_pools, IDX_DIM, generator=gen)
        q = torch.randn(tokens, IDX_HEADS, IDX_DIM, generator=gen) * IDX_DIM**-0.5
    w = torch.randn(tokens, IDX_HEADS, generator=gen) * IDX_HEADS**-0.5
    dtype = torch.float32 if DRY else torch.bfloat16
    return q.to(DEV, dtype), w.to(DEV), keys.to(DEV, dtype)


def one_sequence_meta(tokens: int) -> dict[str, torch.Tensor]:
    pos = torch.arange(tokens, device=DEV)
    return {
        "pool_table": torch.arange(tokens // KPOOL, device=DEV)[None],
        "req_to_token": pos[None].int(),
        "token_seq": torch.zeros(tokens, dtype=torch.long, device=DEV),
        "token_rows": torch.zeros(tokens, dtype=torch.long, device=DEV),
        "positions": pos,
        "pad_index": pos[None],
        "pad_valid": torch.ones(1, tokens, dtype=torch.bool, device=DEV),
    }


def indexer_bench(quick: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = INDEXER_TOKENS
    meta = one_sequence_meta(tokens)
    score_args = (meta["pool_table"], meta["positions"], meta["pad_index"], meta["pad_valid"], KPOOL)
    q, w, keys = indexer_inputs(tokens, realistic=True, gen=gen)
    k8, s8 = iref.quantize_fp8_rows(keys)
    variants = {"bf16": (keys, None), "fp8": (k8, s8)}
    causal_flops = 2 * IDX_HEADS * IDX_DIM * sum((t + 1) // KPOOL for t in range(tokens))
    configs = [
        dict(),  # pools-major, 4 tokens x (64 FP8 | 128 bf16) pools, 4 warps, no FP8 promotion
        dict(block_p=64),
        dict(block_p=128),
        dict(fp8_acc_k=32),  # FP8 only: promote the partial sums every 32 products
    ]
    best: dict[str, float] = {}
    for name, (pk, ps) in variants.items():
        for cfg in configs if not (quick or DRY) else configs[:2]:
            if (name == "fp8" and DRY) or (name == "bf16" and "fp8_acc_k" in cfg):
                continue  # FP8 kernels are checked on the GPU only
            try:
                t = bench(lambda pk=pk, ps=ps, cfg=cfg: ik.index_scores(q, w, pk, ps, *score_args, **cfg))
            except Exception as e:
                rec(f"indexer_score_{name}[{cfg or 'default'}]_error", repr(e)[:300])
                continue
            rec(f"indexer_score_{name}_T{tokens}_ms[{cfg or 'default'}]", round(t / 1e3, 4))
            best[name] = min(best.get(name, math.inf), t)
        if name in best:
            rec(f"indexer_score_{name}_T{tokens}_best_ms", round(best[name] / 1e3, 4))
            rec(
                f"indexer_score_{name}_T{tokens}_best_TFLOPs_causal",
                round(causal_flops / (best[name] * 1e-6) / 1e12, 1),
            )
    if "fp8" in best:
        rec("indexer_bf16_over_fp8", round(best["bf16"] / best["fp8"], 2))

    logits = ik.index_scores(q, w, *((keys, None) if DRY else (k8, s8)), *score_args)
    topk_args = (
        meta["positions"],
        meta["token_seq"],
        meta["token_rows"],
        meta["pool_table"],
        meta["req_to_token"],
    )
    for cfg in [dict(), dict(num_warps=8), dict(radix_bits=1)] if not DRY else [dict()]:
        t = bench(lambda cfg=cfg: ik.topk_rows(logits, *topk_args, KPOOL, TOPK, True, **cfg))
        rec(f"indexer_topk_T{tokens}_ms[{cfg or 'default'}]", round(t / 1e3, 4))
    if not DRY:  # radix 1 and 2 select the same rows
        same = ik.topk_rows(logits, *topk_args, KPOOL, TOPK, True, radix_bits=1)
        rec(
            "parity_topk_radix1_vs_radix2",
            bool((same == ik.topk_rows(logits, *topk_args, KPOOL, TOPK, True)).all()),
        )

    def naive_scores():  # torch: bf16 matmul, ReLU, head-weighted sum, causal mask
        s = torch.relu(q.view(-1, IDX_DIM) @ keys.T).view(tokens, IDX_HEADS, -1)
        s = torch.einsum("th,thp->tp", w, s.float())
        vis = (meta["positions"] + 1) // KPOOL
        return s.masked_fill(torch.arange(s.shape[1], device=DEV)[None] >= vis[:, None], float("-inf"))

    rec(f"indexer_score_naive_torch_T{tokens}_ms", round(bench(naive_scores, rep=50) / 1e3, 3))

    # compression of all 3328 pools of the prompt (bf16 and FP8 caches)
    raw_keys = torch.randn(tokens, IDX_DIM, device=DEV, dtype=torch.bfloat16)
    gates = torch.randn(tokens, IDX_DIM, device=DEV, dtype=torch.bfloat16)
    ape = torch.randn(KPOOL, IDX_DIM, device=DEV)
    pools = torch.arange(tokens // KPOOL, device=DEV)
    pooled = torch.empty(tokens // KPOOL, IDX_DIM, device=DEV, dtype=torch.bfloat16)
    pooled8 = torch.empty(tokens // KPOOL, IDX_DIM, device=DEV, dtype=torch.float8_e4m3fn)
    scale8 = torch.empty(tokens // KPOOL, device=DEV)
    rec(
        "compress_T13312_bf16_us",
        round(bench(lambda: ik.compress_pools(raw_keys, gates, ape, pools, pooled)), 1),
    )
    if DRY:  # FP8 stores are checked on the GPU only
        return
    rec(
        "compress_T13312_fp8_us",
        round(bench(lambda: ik.compress_pools(raw_keys, gates, ape, pools, pooled8, scale8)), 1),
    )
    ref, ref8, ref_s = torch.empty_like(pooled), torch.empty_like(pooled8), torch.empty_like(scale8)
    iref.compress_pools(raw_keys, gates, ape, pools, ref)
    iref.compress_pools(raw_keys, gates, ape, pools, ref8, ref_s)
    rec("parity_compress_bf16_relerr", round(rel_err(pooled, ref), 5))
    rec("parity_compress_fp8_scale_equal_share", round(float((scale8 == ref_s).float().mean()), 4))
    deq, deq_ref = pooled8.float() * scale8[:, None], ref8.float() * ref_s[:, None]
    err = (deq - deq_ref).abs().amax(-1) / deq_ref.abs().amax(-1)
    rec("parity_compress_fp8_max_err_over_row_amax", round(float(err.max()), 4))


def slot_layout(meta: dict[str, torch.Tensor]) -> iref.SlotLayout:
    names = ("pool_table", "req_to_token", "token_seq", "token_rows", "positions", "pad_index", "pad_valid")
    return iref.SlotLayout(*(meta[k] for k in names))


def indexer_quality() -> None:
    """FP8 vs bf16 kernel selections (share of the bf16 pools FP8 also picks), and kernel vs reference."""
    gen = torch.Generator().manual_seed(4)
    tokens = INDEXER_TOKENS
    meta = one_sequence_meta(tokens)
    layout = slot_layout(meta)
    selection = iref.Selection(KPOOL, TOPK, True)
    score_args = (meta["pool_table"], meta["positions"], meta["pad_index"], meta["pad_valid"], KPOOL)
    topk_args = (
        meta["positions"],
        meta["token_seq"],
        meta["token_rows"],
        meta["pool_table"],
        meta["req_to_token"],
    )
    for realistic in (True, False):
        q, w, keys = indexer_inputs(tokens, realistic, gen)
        k8, s8 = iref.quantize_fp8_rows(keys)
        rows_bf = ik.select_slots(q, w, iref.PooledKeys(keys), layout, selection)
        t0 = (TOPK // KPOOL) * KPOOL  # tokens before this see <= 512 pools: both take them all
        a = (rows_bf[t0:, :TOPK].long() // KPOOL).sort(-1).values
        tag = "realistic" if realistic else "gaussian"
        for acc_k in (128,):
            if DRY:
                continue
            logits = ik.index_scores(q, w, k8, s8, *score_args, fp8_acc_k=acc_k)
            rows_f8 = ik.topk_rows(logits, *topk_args, KPOOL, TOPK, True)
            b = (rows_f8[t0:, :TOPK].long() // KPOOL).sort(-1).values
            hits = torch.searchsorted(b, a)
            found = (b.gather(1, hits.clamp(max=b.shape[1] - 1)) == a).float().mean(-1)
            rec(f"fp8_vs_bf16_pool_overlap_{tag}_acc{acc_k}_mean", round(float(found.mean()), 4))
            rec(f"fp8_vs_bf16_pool_overlap_{tag}_acc{acc_k}_min", round(float(found.min()), 4))
    # exact selection vs the reference on a sample of queries (reference is dense: sample 256)
    n_sample = 16 if DRY else 256
    sample = torch.randperm(tokens, generator=gen)[:n_sample].sort().values.to(DEV)
    sub = {k: v for k, v in meta.items()}
    sub.update(
        positions=meta["positions"][sample],
        token_seq=meta["token_seq"][sample],
        token_rows=meta["token_rows"][sample],
        pad_index=torch.arange(n_sample, device=DEV)[None],
        pad_valid=torch.ones(1, n_sample, dtype=torch.bool, device=DEV),
    )
    sub_layout = slot_layout(sub)
    for name, pooled in {"bf16": iref.PooledKeys(keys), "fp8": iref.PooledKeys(k8, s8)}.items():
        if DRY and name == "fp8":
            continue
        got = ik.select_slots(q[sample], w[sample], pooled, sub_layout, selection)
        ref = iref.select_slots(q[sample], w[sample], pooled, sub_layout, selection)
        same = [
            set(g[g >= 0].tolist()) == set(r[r >= 0].tolist())
            for g, r in zip(got.cpu(), ref.cpu(), strict=True)
        ]
        rec(f"parity_select_{name}_identical_rows", f"{sum(same)}/{len(same)}")


SUMMARY_WORDS = (
    "best",
    "sweep",
    "floor",
    "naive",
    "cold",
    "overlap",
    "prefill",
    "TFLOPs",
    "topk",
    "ratio",
    "over",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default configs only")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--only", default="", help="comma-separated sections (default: all)")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, interpreter, tiny sizes (checks the script)"
    )
    parser.add_argument("--sweep-tokens", default="8", help="query tokens swept by mla_decode_sweep")
    parser.add_argument(
        "--cuda-variants", default=None, type=lambda text: [v for v in text.split(",") if v],
        help=f"comma-separated CUDA prefill variants to time (default: all of {list(CUDA_VARIANTS)})",
    )  # fmt: skip
    args = parser.parse_args()
    rec("gpu", "none (dry run)" if DRY else torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    rec("triton", triton.__version__)
    only = set(filter(None, args.only.split(",")))
    section("ceilings", ceilings)  # the floors and percentages below need these
    for name, fn, *rest in [
        ("mla_parity", mla_parity),
        ("mla_decode", mla_decode, args.quick),
        ("mla_decode_sweep", mla_decode_sweep, [int(t) for t in args.sweep_tokens.split(",")]),
        ("mla_prefill", mla_prefill, args.quick, args.cuda_variants),
        ("indexer", indexer_bench, args.quick),
        ("indexer_quality", indexer_quality),
    ]:
        if name in only or (not only and name != "mla_decode_sweep"):  # the sweep only when named
            section(name, fn, *rest)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sparse.json").write_text(json.dumps(RESULTS, indent=1))
    print("\n== summary ==")
    for key, value in RESULTS.items():
        if "error" not in key and any(w in key for w in SUMMARY_WORDS):
            print(f"{key:60s} {value}")


if __name__ == "__main__":
    main()
