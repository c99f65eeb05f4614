"""mHC kernels on the GPU: real-shape parity, then timings of hylo's Triton kernels against eager
torch, `torch.compile` of the torch reference and the memory floor, all measured in the same run.
(The MoE part of this benchmark is still to come.)

    python benchmarks/kernels/mhc_moe.py [--sweep] [--no-compile] [--out DIR]
    python benchmarks/kernels/mhc_moe.py --dry-run   # CPU, Triton interpreter, tiny sizes, fake timers

Shapes follow GLM-5.3-Flash: hidden 4096, 4 streams, 24 projection rows, 20 Sinkhorn iterations,
bf16 streams and `fn` (as the engine loads them), fp32 base and scale. Decode sizes (M = 1, 16, 64)
are timed as CUDA-graph replays, M = 13312 with plain launches. The floor is the bytes each op must
move (streams, out, block input; `fn` and the weights are left out) at the copy bandwidth measured
first; for post_pre and enter (post_pre with the block's RMSNorm, as a decoder layer runs it) it is that
of a single pass, which hylo's two passes cannot reach; their *_apart rows time post, pre and the RMSNorm
kernel as separate launches (the way before the fused decode plan) in the same run.
Prints a table last and writes `mhc_moe.json` to --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
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

from harness import RESULTS, bench, bench_graph, rec, section  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.ops.mhc import BlockNorm, HCParams, PendingPost, kernels, reference  # noqa: E402
from hylo.ops.mhc.kernels import DECODE_PLAN, PREFILL_PLAN, SplitPlan  # noqa: E402

HIDDEN, N, ITERS, RMS_EPS, HC_EPS = (64 if DRY else 4096), 4, 20, 1e-6, 1e-6
DECODE = (1, 16, 64) if not DRY else (1, 16)
PREFILL = 13312 if not DRY else 40
DEV = "cpu" if DRY else "cuda"
DTYPE = torch.float32 if DRY else torch.bfloat16  # the interpreter's bf16 dot and casts are not exact


def timed(tokens: int):
    return bench_graph if tokens <= 64 else bench


# ---------------------------------------------------------------- inputs


def case(tokens: int, seed: int, fn_dtype=None):
    """Streams with a realistic spread, the block output, one hyper-connection's parameters and the
    previous block's post/comb (from the reference, so comb is doubly stochastic)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    streams = torch.randn(tokens, N, HIDDEN, generator=g, device=DEV).to(DTYPE)
    out = torch.randn(tokens, HIDDEN, generator=g, device=DEV).to(DTYPE)
    fn = (torch.randn(24, N * HIDDEN, generator=g, device=DEV) * (N * HIDDEN) ** -0.5).to(fn_dtype or DTYPE)
    base = torch.randn(24, generator=g, device=DEV) * 0.5
    scale = torch.rand(3, generator=g, device=DEV) + 0.5
    params = HCParams(fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    post, comb, _ = reference.mhc_pre(torch.randn_like(streams), params)
    return streams, out, params, post, comb


def block_norm() -> BlockNorm:
    """A decoder layer's RMSNorm of the block input (bf16 weight, as loaded)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    return BlockNorm((1 + 0.1 * torch.randn(HIDDEN, generator=g, device=DEV)).to(DTYPE), 1e-5)


def stream_bytes(tokens: int, *, streams_read: int, out_read: int, streams_written: int, inputs_written: int):
    elt = torch.finfo(DTYPE).bits // 8
    return tokens * HIDDEN * elt * (N * streams_read + out_read + N * streams_written + inputs_written)


# ---------------------------------------------------------------- ceilings


def ceilings() -> None:
    x = torch.randn(1 << (16 if DRY else 29), device=DEV, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    rec("copy_TBps", round(2 * x.numel() * 2 / (t * 1e-6) / 1e12, 2))


# ---------------------------------------------------------------- parity


def diff(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    g, r = got.double(), ref.double()
    rec(
        name,
        {
            "max_abs": float((g - r).abs().max()),
            "rel_l2": float((g - r).norm() / r.norm()),
            "share_not_equal": round(float((got != ref).double().mean()), 6),
        },
    )


def hylo_post_pre(out, streams, post, comb, params, plan: SplitPlan | None = None, norm=None):
    """What `hylo.ops.mhc.mhc_enter` runs on CUDA: under the decode plan post mixed by pre's projection
    launch and `norm` (when given) applied by its finishing launch; otherwise as `hylo_apart`."""
    return kernels.mhc_enter(streams, params, PendingPost(out, post, comb), norm, plan=plan)


def hylo_apart(out, streams, post, comb, params, plan: SplitPlan | None = None, norm=None):
    """Post, pre and the RMSNorm kernel (when `norm`) as launches of their own (before the fused plan)."""
    from hylo.ops.norm import kernels as norm_kernels

    plan = dataclasses.replace(plan or kernels.default_plan(streams.shape[0]), fuse_post=False)
    new = kernels.mhc_post(out, streams, post, comb)
    post, comb, x = kernels.mhc_pre(new, params, plan=plan)
    return new, post, comb, x if norm is None else norm_kernels.rms_norm(x, norm.weight, norm.eps)


def parity() -> None:
    for tokens in (*DECODE, PREFILL):
        parity_at(tokens)
    for tokens, plan in ((DECODE[-1], PREFILL_PLAN), (PREFILL, DECODE_PLAN)):  # each size on the other plan
        streams, _, params, _, _ = case(tokens, seed=tokens)
        got = kernels.mhc_pre(streams, params, plan=plan)
        for part, a, b in zip(
            ("post", "comb", "input"), got, reference.mhc_pre(streams, params), strict=True
        ):
            diff(f"parity_pre_M{tokens}_{plan}_{part}", a, b)
    streams, _, params, _, _ = case(64, seed=5, fn_dtype=torch.float32)  # fp32 fn: the split projection
    _, ref_comb, ref_x = reference.mhc_pre(streams, params)
    _, got_comb, got_x = kernels.mhc_pre(streams, params)
    diff("parity_pre_fp32fn_M64_comb", got_comb, ref_comb)
    diff("parity_pre_fp32fn_M64_input", got_x, ref_x)


def parity_at(tokens: int) -> None:
    streams, out, params, post, comb = case(tokens, seed=tokens)
    for part, a, b in zip(
        ("post", "comb", "input"),
        kernels.mhc_pre(streams, params),
        reference.mhc_pre(streams, params),
        strict=True,
    ):
        diff(f"parity_pre_M{tokens}_{part}", a, b)
    # post against the exact mix (fp64, weights cast to the streams' dtype as the reference casts them)
    exact = post.to(DTYPE).double()[..., None] * out.double()[:, None, :]
    exact += comb.to(DTYPE).double().transpose(-1, -2) @ streams.double()
    new = kernels.mhc_post(out, streams, post, comb)
    for name, got in (("hylo", new), ("torch", reference.mhc_post(out, streams, post, comb))):
        rec(
            f"parity_post_M{tokens}_{name}_vs_exact",
            {
                "max_abs": float((got.double() - exact).abs().max()),
                "share_correctly_rounded": round(float((got == exact.to(DTYPE)).double().mean()), 6),
            },
        )
    del exact
    norm = block_norm()
    for op, norm_or_none in (("post_pre", None), ("enter", norm)):
        ref = reference.mhc_enter(streams, params, PendingPost(out, post, comb), norm_or_none)
        got = hylo_post_pre(out, streams, post, comb, params, norm=norm_or_none)
        apart = hylo_apart(out, streams, post, comb, params, norm=norm_or_none)
        for part, a, b, c in zip(("streams", "post", "comb", "input"), got, ref, apart, strict=True):
            diff(f"parity_{op}_M{tokens}_{part}_vs_torch", a, b)
            diff(f"parity_{op}_M{tokens}_{part}_vs_apart", a, c)
    got = hylo_post_pre(out, streams, post, comb, params)
    # the same launches again give the same bits: no program's result depends on another's timing
    again = hylo_post_pre(out, streams, post, comb, params)
    rec(f"repeat_post_pre_M{tokens}_bitwise_equal", all(map(torch.equal, got, again)))


def stress() -> None:
    """Many back-to-back launches of mixed sizes: every result equals the first of its size."""
    cases = {m: case(m, seed=100 + m) for m in ((1, PREFILL) if DRY else (1, 64, 3000))}  # both plans
    first = {m: hylo_post_pre(out, s, p, c, prm) for m, (s, out, prm, p, c) in cases.items()}
    same = True
    for _ in range(3 if DRY else 50):
        for m, (s, out, prm, p, c) in cases.items():
            same &= all(map(torch.equal, hylo_post_pre(out, s, p, c, prm), first[m]))
    rec("stress_mixed_sizes_bitwise_equal", bool(same))


# ---------------------------------------------------------------- plan sweep

SWEEP_PREFILL: list[SplitPlan] = [  # split 512 / 2048 and 8-token collapses measured slower in session 3
    PREFILL_PLAN,
    # larger token blocks: every projection program reads fn's slice (24 × 4·split fp32) once per block
    dataclasses.replace(PREFILL_PLAN, block_m=64, block_k=64),
    dataclasses.replace(PREFILL_PLAN, block_m=64, block_k=128),
    dataclasses.replace(PREFILL_PLAN, block_m=32, block_k=64),
    dataclasses.replace(PREFILL_PLAN, block_m=128, block_k=64),
    dataclasses.replace(PREFILL_PLAN, block_m=64, block_k=64, split=2048),
    dataclasses.replace(PREFILL_PLAN, block_m=64, block_k=64, collapse_tokens=8, collapse_k=512),
]
SWEEP_DECODE: list[SplitPlan] = [
    DECODE_PLAN,
    dataclasses.replace(DECODE_PLAN, collapse_chunk=1024, collapse_k=512),
    dataclasses.replace(DECODE_PLAN, split=32),
    dataclasses.replace(DECODE_PLAN, split=128, block_k=64),
    dataclasses.replace(DECODE_PLAN, collapse_chunk=512, collapse_k=512),
    dataclasses.replace(DECODE_PLAN, block_m=64, num_warps=8),
]
# A prefill layer's whole entry (the previous block's post, pre and the block's RMSNorm, issue 45's 400 us at
# M = 13312): the prefill plan launches post and the norm apart (4 launches); finishing programs of whole rows
# fuse the norm (one token a program, 4096 dims in one step). Post mixed by the projection reads the
# streams once where post then pre read them twice (436 MB fewer at 13312 tokens), but under the prefill
# plan's tiles (64 tokens x 128 dims, 4 warps) its five fp32 tiles (out and four streams) need ~320
# registers a thread: 1660 us against 751 (S37-4). The "_k32" / "_k64" variants give them room.
_WHOLE_ROWS = dict(collapse_tokens=1, collapse_chunk=HIDDEN, collapse_k=HIDDEN)
SWEEP_ENTER_PREFILL: dict[str, SplitPlan] = {
    "prefill_plan": PREFILL_PLAN,
    "post_fused": dataclasses.replace(PREFILL_PLAN, fuse_post=True),
    "norm_fused": dataclasses.replace(PREFILL_PLAN, **_WHOLE_ROWS),
    "both_fused": dataclasses.replace(PREFILL_PLAN, fuse_post=True, **_WHOLE_ROWS),
    "both_fused_k32_w4": dataclasses.replace(PREFILL_PLAN, fuse_post=True, block_k=32, **_WHOLE_ROWS),
    "both_fused_k32_w8": dataclasses.replace(
        PREFILL_PLAN, fuse_post=True, block_k=32, num_warps=8, **_WHOLE_ROWS
    ),
    "both_fused_k64_w8": dataclasses.replace(
        PREFILL_PLAN, fuse_post=True, block_k=64, num_warps=8, **_WHOLE_ROWS
    ),
    "both_fused_m32_k64_w8": dataclasses.replace(
        PREFILL_PLAN, fuse_post=True, block_m=32, block_k=64, num_warps=8, **_WHOLE_ROWS
    ),
    "both_fused_m128_k32_w8": dataclasses.replace(
        PREFILL_PLAN, fuse_post=True, block_m=128, block_k=32, num_warps=8, **_WHOLE_ROWS
    ),
}
SWEEP_POST = [(16, 128, 4), (32, 64, 4)]
BEST: dict[str, SplitPlan] = {}  # regime -> plan the timings use (the sweep's fastest when it runs)


def sweep() -> None:
    totals = {p: sweep_at(PREFILL, p) for p in SWEEP_PREFILL}
    BEST["prefill"] = min(totals, key=totals.get)
    for plan in (PREFILL_PLAN, BEST["prefill"]):
        kernel_split(PREFILL, plan)
    decode = {p: sum(sweep_at(m, p) for m in (1, DECODE[-1])) for p in SWEEP_DECODE}
    BEST["decode"] = min(decode, key=decode.get)
    rec("sweep_best", {k: str(v) for k, v in BEST.items()})
    for tokens in (1, PREFILL):
        sweep_post(tokens)
    for name, plan in SWEEP_ENTER_PREFILL.items():
        sweep_enter(PREFILL, name, plan)


def kernel_split(tokens: int, plan: SplitPlan) -> None:
    """GPU time of each of pre's launches under `plan` (profiler, mean of 5 calls)."""
    if DRY:
        return
    from torch.profiler import ProfilerActivity, profile

    streams, _, params, _, _ = case(tokens, seed=7)
    kernels.mhc_pre(streams, params, plan=plan)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            kernels.mhc_pre(streams, params, plan=plan)
        torch.cuda.synchronize()
    split = {e.key[:32]: round(e.device_time_total / e.count, 1) for e in prof.key_averages() if e.count >= 5}
    rec(f"sweep_M{tokens}_{plan}_kernels_us", split)


def sweep_post(tokens: int) -> None:
    streams, out, _, post, comb = case(tokens, seed=7)
    for block_m, block_k, warps in SWEEP_POST:
        t = timed(tokens)(
            lambda b=block_m, k=block_k, w=warps: kernels.mhc_post(
                out, streams, post, comb, block_m=b, block_k=k, num_warps=w
            )
        )
        rec(f"sweep_M{tokens}_post_bm{block_m}_bk{block_k}_w{warps}_us", round(t, 2))


def sweep_enter(tokens: int, name: str, plan: SplitPlan) -> None:
    """A whole entry (`mhc_enter` with a pending post and the block's norm) under `plan`: microseconds, its
    launches and the largest difference from the reference's entry (its streams and block input)."""
    streams, out, params, post, comb = case(tokens, seed=7)
    norm, pending = block_norm(), PendingPost(out, post, comb)

    def enter():
        return kernels.mhc_enter(streams, params, pending, norm, plan=plan)

    try:
        ref = reference.mhc_enter(streams, params, pending, norm)
        got = enter()
        err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, ref, strict=True))
        t = timed(tokens)(enter)
    except Exception as e:
        rec(f"sweep_M{tokens}_enter_{name}_error", repr(e)[:400])
        return
    launches = 2 + (not plan.fuse_post) + (not kernels.norm_fusable(plan, HIDDEN))
    rec(f"sweep_M{tokens}_enter_{name}", {"us": round(t, 2), "launches": launches, "max_abs_err": err})


def sweep_at(tokens: int, plan: SplitPlan) -> float:
    """Pre microseconds of one plan (inf when it fails); post does not depend on the plan."""
    streams, _, params, _, _ = case(tokens, seed=7)

    def pre():
        return kernels.mhc_pre(streams, params, plan=plan)

    try:
        ref = reference.mhc_pre(streams, params)
        err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(pre(), ref, strict=True))
        t_pre = timed(tokens)(pre)
    except Exception as e:
        rec(f"sweep_M{tokens}_{plan}_error", repr(e)[:400])
        return float("inf")
    rec(f"sweep_M{tokens}_{plan}", {"pre_us": round(t_pre, 2), "max_abs_err": err})
    return t_pre


# ---------------------------------------------------------------- timings

# post_pre / enter: as `mhc_enter` runs them (enter with the block's RMSNorm, as a decoder layer calls it);
# *_apart: the same as separate launches (post, pre, RMSNorm kernel), the way before the fused decode plan
OPS = ("pre", "post", "post_pre", "post_pre_apart", "enter", "enter_apart")
TIMES: dict[tuple[int, str, str], float] = {}  # (tokens, op, implementation) -> microseconds


def floor_us(tokens: int, op: str) -> float:
    passes = dict(streams_read=1, out_read=1, streams_written=1, inputs_written=1)
    moved = {
        "pre": stream_bytes(tokens, streams_read=1, out_read=0, streams_written=0, inputs_written=1),
        "post": stream_bytes(tokens, streams_read=1, out_read=1, streams_written=1, inputs_written=0),
    }
    return moved.get(op, stream_bytes(tokens, **passes)) / (RESULTS["copy_TBps"] * 1e12) * 1e6


def hylo_impls(tokens: int, norm: BlockNorm) -> dict:
    regime = "prefill" if tokens == PREFILL else "decode"
    plan = BEST.get(regime, PREFILL_PLAN if regime == "prefill" else DECODE_PLAN)
    rec(f"plan_M{tokens}", str(plan))
    return {
        "pre": lambda streams, params: kernels.mhc_pre(streams, params, plan=plan),
        "post": kernels.mhc_post,
        "post_pre": lambda *args: hylo_post_pre(*args, plan=plan),
        "post_pre_apart": lambda *args: hylo_apart(*args, plan=plan),
        "enter": lambda *args: hylo_post_pre(*args, plan=plan, norm=norm),
        "enter_apart": lambda *args: hylo_apart(*args, plan=plan, norm=norm),
    }


def reference_impls(compiled: bool, norm: BlockNorm) -> dict:
    def enter(out, streams, post, comb, params, norm=None):
        return reference.mhc_enter(streams, params, PendingPost(out, post, comb), norm)

    ops = {"pre": reference.mhc_pre, "post": reference.mhc_post, "post_pre": enter}
    if compiled:  # one compile per shape, as a serving engine with fixed buckets would have
        ops = {op: torch.compile(fn, dynamic=False) for op, fn in ops.items()}
    return ops | {"enter": lambda *args: ops["post_pre"](*args, norm=norm)}


def timings(name: str) -> None:
    norm = block_norm()  # made once: the timed calls are captured into graphs
    for tokens in (*DECODE, PREFILL):
        impls = hylo_impls(tokens, norm) if name == "hylo" else reference_impls(name == "compile", norm)
        timings_at(tokens, name, impls)


def timings_at(tokens: int, name: str, impls: dict) -> None:
    streams, out, params, post, comb = case(tokens, seed=tokens)
    bench_fn = timed(tokens)
    args = {"pre": (streams, params), "post": (out, streams, post, comb)}
    for op, impl in impls.items():
        run = functools.partial(impl, *args.get(op, (out, streams, post, comb, params)))
        run()  # compile / load outside the timed region
        TIMES[tokens, op, name] = bench_fn(run)
        rec(f"time_M{tokens}_{op}_{name}_us", round(TIMES[tokens, op, name], 2))


def table() -> list[str]:
    header = ("M", "op", "hylo_us", "eager_us", "compile_us", "floor_us", "floor/hylo")
    rows = [header]
    for tokens in (*DECODE, PREFILL):
        for op in OPS:
            if (tokens, op, "hylo") not in TIMES:
                continue
            hylo = TIMES[tokens, op, "hylo"]
            others = [TIMES.get((tokens, op, n)) for n in ("eager", "compile")]
            rows.append(
                (
                    str(tokens),
                    op,
                    f"{hylo:.2f}",
                    *(f"{t:.1f}" if t is not None else "-" for t in others),
                    f"{floor_us(tokens, op):.2f}",
                    f"{floor_us(tokens, op) / hylo:.2f}",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


# ---------------------------------------------------------------- compile ahead


def compile_jobs(with_sweep: bool, enter_only: bool = False) -> list[tuple]:
    """(op, plan, fp32 fn) for every kernel variant this run launches; post's plan is (bm, bk, warps)."""
    if enter_only:
        return [("enter", plan, False) for plan in SWEEP_ENTER_PREFILL.values()]
    plans = [DECODE_PLAN, PREFILL_PLAN]
    if with_sweep:
        sweeps = SWEEP_PREFILL + SWEEP_DECODE + list(SWEEP_ENTER_PREFILL.values())
        plans += [p for p in sweeps if p not in plans]
    jobs = [("pre", plan, False) for plan in plans] + [("enter", plan, False) for plan in plans]
    jobs += [("pre", kernels.default_plan(64), True), ("post", None, False)]
    if with_sweep:
        jobs += [("post", cfg, False) for cfg in SWEEP_POST]
    return jobs


def compile_one(job: tuple) -> None:
    op, plan, fp32_fn = job
    streams, out, params, post, comb = case(16, seed=0, fn_dtype=torch.float32 if fp32_fn else None)
    if op == "pre":
        kernels.mhc_pre(streams, params, plan=plan)
    elif op == "enter":  # the fused variants, with and without the norm
        for norm in (None, block_norm()):
            kernels.mhc_enter(streams, params, PendingPost(out, post, comb), norm, plan=plan)
    elif plan is None:
        kernels.mhc_post(out, streams, post, comb)
    else:
        block_m, block_k, warps = plan
        kernels.mhc_post(out, streams, post, comb, block_m=block_m, block_k=block_k, num_warps=warps)
    torch.cuda.synchronize()


def compile_ahead(jobs: list[tuple]) -> None:
    """Compile every variant in parallel processes (spawned before this one touches CUDA); they fill
    Triton's disk cache, so the launches below load instead of compiling one after another."""
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(min(len(jobs), os.cpu_count() or 1, 16)) as pool:
        pool.map(compile_one, jobs)
    rec("compile_ahead_s", round(time.time() - start, 1))


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--sweep", action="store_true", help="time alternative plans; the fastest are used below"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument(
        "--enter-only",
        action="store_true",
        help="only the prefill entry's plans at 13312 tokens",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.enter_only:
        if not DRY:
            section("compile_ahead", compile_ahead, compile_jobs(False, enter_only=True))
            rec("gpu", torch.cuda.get_device_name())
        section("ceilings", ceilings)
        for name, plan in SWEEP_ENTER_PREFILL.items():
            section(f"enter_{name}", sweep_enter, PREFILL, name, plan)
        (out / "mhc_moe.json").write_text(json.dumps(RESULTS, indent=1))
        return
    if not DRY:
        section("compile_ahead", compile_ahead, compile_jobs(args.sweep))
        rec("gpu", torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    section("ceilings", ceilings)
    section("parity", parity)
    section("stress", stress)
    if args.sweep:
        section("sweep", sweep)
    section("timings_hylo", timings, "hylo")
    section("timings_eager", timings, "eager")
    lines = table()  # written before the compile baseline, which may take minutes
    (out / "mhc_moe_table.txt").write_text("\n".join(lines) + "\n")
    if not (args.no_compile or DRY):
        section("timings_compile", timings, "compile")
        lines = table()
    print("\n".join(lines))
    (out / "mhc_moe_table.txt").write_text("\n".join(lines) + "\n")
    (out / "mhc_moe.json").write_text(json.dumps(RESULTS | {"table": lines}, indent=1))


if __name__ == "__main__":
    main()
