"""DFlash draft attention kernels on the GPU: real-shape parity (eager and CUDA-graph replay with new
context lengths), then timings of the Triton kernels against the torch reference and the HBM floor,
all measured in the same run.

    PYTHONPATH=src python benchmarks/kernels/draft_attention.py [--quick] [--out DIR]
    PYTHONPATH=src python benchmarks/kernels/draft_attention.py --dry-run   # CPU, interpreter, tiny sizes

Shapes: R requests in {1, 8, 32}, block B = 8, Hq = 32 over Hkv = 8, d = 128, bf16, every request with
the same committed context (1K / 8K / 32K), plus a 2048-token window on the longest context. The
context lives in shuffled 16-token pages of one layer's token-slot pool. The floor is the context
K/V a call must read (bytes / 4.2 TB/s, the H200's HBM peak); the table, q and the block are left
out. `--quick` skips the tile sweep. Prints a table last and writes `draft_attention.json` to --out
(default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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

from hylo.ops.draft_attention import kernels as K  # noqa: E402
from hylo.ops.draft_attention.reference import (  # noqa: E402
    ContextTable,
    ContextTokens,
    DraftBlock,
    KeyTransform,
    KVCache,
    paged_draft_attention_reference,
    rotary_tables,
    store_context_kv_reference,
)

HBM_BYTES_PER_S = 4.2e12
DEV = torch.device("cpu" if DRY else "cuda")
# The interpreter's bf16 dot is wrong (DESIGN §8): the dry run checks the script in fp16.
DTYPE = torch.float16 if DRY else torch.bfloat16
BLOCK, HEADS, KV_HEADS, HEAD_DIM = (4, 8, 2, 32) if DRY else (8, 32, 8, 128)
REQUESTS = (1, 2) if DRY else (1, 8, 32)
CONTEXTS = (40, 100) if DRY else (1024, 8192, 32768)
WINDOW = 24 if DRY else 2048
PAGE = 16
DRAFT_LAYERS, STORE_TOKENS = (2, (8, 40)) if DRY else (5, (256, 8192))
SCALE = HEAD_DIM**-0.5
# (block_n, num_warps, num_stages) tried by the sweep, with 1/2, 1, 2 and 4 x the default split count
SWEEP = [(16, 4, 2)] if DRY else [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]
ROWS: list[dict[str, object]] = []


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def paged_case(num_requests: int, ctx_len: int, gen: torch.Generator):
    """Inputs of `paged_draft_attention` for requests of `ctx_len` committed tokens each, their
    context scattered over shuffled pages of a pool sized for exactly these requests (drawn on the
    device: the 32K x 32 pool is 2 GiB a cache)."""
    max_len = ctx_len + BLOCK
    pages_per_request = triton.cdiv(max_len, PAGE)
    num_pages = num_requests * pages_per_request
    page_order = torch.randperm(num_pages, generator=gen, device=DEV).view(num_requests, pages_per_request)
    table = (page_order[:, :, None] * PAGE + torch.arange(PAGE, device=DEV)).flatten(1)[:, :max_len].int()
    num_slots = num_pages * PAGE

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(DTYPE)

    q = randn(num_requests, BLOCK, HEADS, HEAD_DIM)
    k_block, v_block = (
        randn(num_requests, BLOCK, KV_HEADS, HEAD_DIM),
        randn(num_requests, BLOCK, KV_HEADS, HEAD_DIM),
    )
    k_cache, v_cache = randn(num_slots, KV_HEADS, HEAD_DIM), randn(num_slots, KV_HEADS, HEAD_DIM)
    rows = torch.arange(num_requests, device=DEV)
    ctx_lens = torch.full((num_requests,), ctx_len, dtype=torch.int32, device=DEV)
    return [q, k_block, v_block, k_cache, v_cache, table, rows, ctx_lens]


def paged(case):
    """The typed operands (block, cache, table) of a `paged_case`, sharing its tensors."""
    return DraftBlock(*case[:3]), KVCache(*case[3:5]), ContextTable(*case[5:])


def context_bytes(ctx_lens: torch.Tensor, window: int | None) -> int:
    """K and V bytes of the context keys some block row can see."""
    lens = ctx_lens.long().cpu()
    seen = lens if window is None else lens.clamp(max=window - 1)
    return int(seen.sum()) * 2 * KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def attention_parity() -> None:
    """Real shapes against the reference, with mixed lengths (0, short, not a multiple of a tile)."""
    gen = torch.Generator(DEV).manual_seed(0)
    for window in (None, WINDOW):
        case = paged_case(4, CONTEXTS[-1], gen)
        case[7] = torch.tensor([0, 1, CONTEXTS[0] + 5, CONTEXTS[-1]], dtype=torch.int32, device=DEV)
        out = K.paged_draft_attention(*paged(case), SCALE, window)
        ref = paged_draft_attention_reference(*paged(case), SCALE, window)
        rec(f"parity_attention_window{window}_rel_err", f"{rel_err(out, ref):.2e}")
        rec(
            f"parity_attention_window{window}_max_abs",
            f"{(out.float() - ref.float()).abs().max().item():.2e}",
        )


def attention_graph_replay() -> None:
    """Capture once, then change the lengths on the device and replay: the result follows them."""
    gen = torch.Generator(DEV).manual_seed(1)
    case = paged_case(8, CONTEXTS[1], gen)
    K.paged_draft_attention(*paged(case), SCALE, WINDOW)  # compile outside the capture
    if DRY:  # no graphs on the CPU: one eager call stands in for the replay
        replay = lambda: K.paged_draft_attention(*paged(case), SCALE, WINDOW)  # noqa: E731
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = K.paged_draft_attention(*paged(case), SCALE, WINDOW)

        def replay():
            graph.replay()
            return out

    worst = 0.0
    for trial in range(3):
        lens = torch.randint(0, CONTEXTS[1] + 1, (8,), generator=gen, device=DEV)
        lens[trial] = 0
        case[7].copy_(lens)
        got = replay()
        worst = max(worst, rel_err(got, paged_draft_attention_reference(*paged(case), SCALE, WINDOW)))
    rec("parity_graph_replay_new_lengths_rel_err", f"{worst:.2e}")


def attention_timings(quick: bool) -> None:
    gen = torch.Generator(DEV).manual_seed(2)
    shapes = [(r, c, None) for r in REQUESTS for c in CONTEXTS] + [
        (r, CONTEXTS[-1], WINDOW) for r in REQUESTS
    ]
    for num_requests, ctx_len, window in shapes:
        case = paged_case(num_requests, ctx_len, gen)
        name = f"R{num_requests}_ctx{ctx_len}_window{window}"
        splits = K.default_num_splits(
            num_requests, KV_HEADS, case[5].shape[1], window, K.CONTEXT_TILES["block_n"], DEV
        )
        out = K.paged_draft_attention(*paged(case), SCALE, window)
        ref = paged_draft_attention_reference(*paged(case), SCALE, window)
        floor = context_bytes(case[7], window) / HBM_BYTES_PER_S * 1e6
        ops = paged(case)  # built once: the eager timings hold the launches alone
        kernel = bench(lambda ops=ops, window=window: K.paged_draft_attention(*ops, SCALE, window))
        graph = bench_graph(lambda ops=ops, window=window: K.paged_draft_attention(*ops, SCALE, window))
        reference = bench(
            lambda ops=ops, window=window: paged_draft_attention_reference(*ops, SCALE, window),
            rep=30,
        )
        best, best_cfg = graph, f"default {K.CONTEXT_TILES} splits {splits}"
        for block_n, warps, stages in [] if quick else SWEEP:
            cfg_splits = K.default_num_splits(num_requests, KV_HEADS, case[5].shape[1], window, block_n, DEV)
            for num_splits in sorted({max(1, cfg_splits // 2), cfg_splits, 2 * cfg_splits, 4 * cfg_splits}):
                tiles = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=num_splits)
                t = bench_graph(lambda case=case, window=window, tiles=tiles: K.paged_draft_attention(
                    *paged(case), SCALE, window, **tiles))  # fmt: skip
                if t < best:
                    best, best_cfg = t, str(tiles)
        row = {
            "shape": name, "splits": splits, "rel_err": f"{rel_err(out, ref):.1e}",
            "eager_us": round(kernel, 1), "graph_us": round(graph, 1), "best_us": round(best, 1),
            "reference_us": round(reference, 1), "floor_us": round(floor, 2),
            "floor_pct": round(100 * floor / best, 1),
        }  # fmt: skip
        ROWS.append(row)
        rec(f"attention_{name}", row)
        rec(f"attention_{name}_best_cfg", best_cfg)


def store_case(num_tokens: int, gen: torch.Generator):
    """Inputs of `store_context_kv`: every eighth token rejected (slot -1), slots shuffled."""
    shape = (DRAFT_LAYERS, num_tokens, KV_HEADS, HEAD_DIM)
    k_raw, v = (torch.randn(*shape, generator=gen, device=DEV).to(DTYPE) for _ in "kv")
    weight = (1 + 0.2 * torch.randn(DRAFT_LAYERS, HEAD_DIM, generator=gen, device=DEV)).to(DTYPE)
    cos, sin = rotary_tables(4 * num_tokens, HEAD_DIM, 1e6, DEV)
    positions = torch.randint(0, 4 * num_tokens, (num_tokens,), generator=gen, device=DEV)
    slots = torch.randperm(2 * num_tokens, generator=gen, device=DEV)[:num_tokens]
    slots[::8] = -1
    cache_shape = (DRAFT_LAYERS, 2 * num_tokens, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.zeros(cache_shape, dtype=DTYPE, device=DEV) for _ in "kv")
    return [k_raw, v, weight, 1e-6, cos, sin, positions, slots, k_cache, v_cache]


def stored(args, k_cache=None, v_cache=None):
    """The typed operands (tokens, keys, cache) of a `store_case`, sharing its tensors; the cache
    `k_cache`, `v_cache` instead of its own where given."""
    k_raw, v, weight, eps, cos, sin, positions, slots = args[:8]
    cache = KVCache(args[8], args[9]) if k_cache is None else KVCache(k_cache, v_cache)
    return ContextTokens(k_raw, v, positions, slots), KeyTransform(weight, eps, cos, sin), cache


def store_bench() -> None:
    gen = torch.Generator(DEV).manual_seed(3)
    for num_tokens in STORE_TOKENS:
        args = store_case(num_tokens, gen)
        expected = [args[8].clone(), args[9].clone()]
        store_context_kv_reference(*stored(args, *expected))
        K.store_context_kv(*stored(args))
        untouched = torch.ones(args[8].shape[1], dtype=torch.bool, device=DEV)
        untouched[args[7][args[7] >= 0]] = False
        name = f"store_L{DRAFT_LAYERS}_N{num_tokens}"
        rec(f"parity_{name}_k_max_abs", f"{(args[8].float() - expected[0].float()).abs().max().item():.2e}")
        rec(f"parity_{name}_v_exact", bool(torch.equal(args[9], expected[1])))
        rec(f"parity_{name}_skipped_rows_untouched", bool((args[8][:, untouched] == 0).all()))
        kept = int((args[7] >= 0).sum())
        moved = (
            4 * DRAFT_LAYERS * kept * KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
        )  # k, v in and out
        floor = moved / HBM_BYTES_PER_S * 1e6
        ops = stored(args)
        kernel = bench_graph(lambda ops=ops: K.store_context_kv(*ops))
        reference = bench(lambda ops=ops: store_context_kv_reference(*ops))
        row = {"shape": name, "graph_us": round(kernel, 1), "reference_us": round(reference, 1),
               "floor_us": round(floor, 2), "floor_pct": round(100 * floor / kernel, 1)}  # fmt: skip
        ROWS.append(row)
        rec(name, row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="default tiles only (no sweep)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, interpreter, tiny sizes (checks the script)"
    )
    args = parser.parse_args()
    rec("gpu", "none (dry run)" if DRY else torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    rec("triton", triton.__version__)
    section("attention_parity", attention_parity)
    section("attention_graph_replay", attention_graph_replay)
    section("attention_timings", attention_timings, args.quick)
    section("store", store_bench)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "draft_attention.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n== summary (us: medians; graph = do_bench_cudagraph; best = best swept tiles, graph) ==")
    for key, value in RESULTS.items():
        if "error" in key or key.startswith("parity"):
            print(f"{key:50s} {value}")
    columns = list(dict.fromkeys(c for row in ROWS for c in row))
    print(" | ".join(f"{c:>14s}" for c in columns))
    for row in ROWS:
        print(" | ".join(f"{row.get(c, '')!s:>14s}" for c in columns))


if __name__ == "__main__":
    main()
