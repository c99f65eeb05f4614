# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""KDA kernels on the GPU: real-shape parity, then hylo vs FLA timings on the same inputs (one run).

GLM-5.3-Flash shapes: 64 heads, d = 128, bf16 activations, fp32 state. Usage (FLA optional):

    PYTHONPATH=src python benchmarks/kernels/kda.py [--quick] [--only prefill|step] [--out DIR]
    KDA_BENCH_HEADS=8 ... (a TP8 rank's heads; the default is the model's 64)

Prints a table last; writes every figure to DIR/kda.json (default $OUT or ./out). Small launches are
timed with `do_bench_cudagraph`, prefill with `do_bench`; all medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

# import hylo.ops.kda without running hylo/__init__ (the engine is not needed here)
_src = Path(__file__).resolve().parents[2] / "src" / "hylo"
if "hylo" not in sys.modules:
    _pkg = types.ModuleType("hylo")
    _pkg.__path__ = [str(_src)]
    sys.modules["hylo"] = _pkg
from hylo.ops.kda import (  # noqa: E402
    KDAInputs,
    KDAParams,
    KDASlots,
    OutputNorm,
    chunk,
    recurrent,
    reference,
    rmsnorm,
)

# KDA_BENCH_HEADS: a rank's heads (8 at TP8, 16 at TP4) in place of GLM-5.3-Flash's 64
H, D, W, LB = int(os.environ.get("KDA_BENCH_HEADS", "64")), 128, 4, -5.0
DEV, ACT = "cuda", torch.bfloat16
if os.environ.get("KDA_BENCH_DRY") == "1":  # a CPU walk-through of the script under TRITON_INTERPRET=1
    # the interpreter's bf16 dot is wrong (numpy has no bf16): the dry run's activations are fp32, or its
    # parity figures read ~1e12 for kernels that match the reference on the GPU (~4e-3)
    H, D, DEV, ACT = 2, 16, "cpu", torch.float32
HD = H * D


def L(n: int) -> int:
    """A sequence length (shrunk for the dry run)."""
    return max(1, n // 64) if DEV == "cpu" else n


RES: dict[str, object] = {}


def rec(key: str, val) -> None:
    RES[key] = val
    print(f"{key}: {val}", flush=True)


def err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def bench(fn, graph: bool) -> float:
    """Median microseconds."""
    fn()
    if DEV == "cpu":
        return 1.0
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
    return do_bench(fn, warmup=10, rep=80, return_mode="median") * 1e3


class Layer:
    """Random parameters and a slot pool of `slots` requests for one KDA layer."""

    def __init__(self, slots: int, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.gen = g
        self.conv_weight = torch.randn(3 * HD, W, device=DEV, generator=g) * 0.3
        self.dt_bias = torch.randn(HD, device=DEV, generator=g) * 0.5
        self.a_log = torch.randn(H, device=DEV, generator=g) * 0.5
        self.conv_pool = torch.randn(slots, W - 1, 3 * HD, device=DEV, generator=g).to(ACT)
        self.state_pool = torch.randn(slots, H, D, D, device=DEV, generator=g) * 0.05

    def inputs(self, *lead):
        r = [torch.randn(*lead, HD, device=DEV, generator=self.gen).to(ACT) for _ in range(4)]
        return [*r, torch.randn(*lead, H, device=DEV, generator=self.gen).to(ACT)]

    def params(self) -> KDAParams:
        return KDAParams(self.conv_weight, self.dt_bias, self.a_log, LB)

    def pools(self):
        return self.conv_pool.clone(), self.state_pool.clone()


def offsets(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu, torch.tensor(cu, dtype=torch.int32, device=DEV)


def fla_api():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return chunk_kda, fused_recurrent_kda
    except Exception as e:  # FLA is optional
        rec("fla_error", repr(e)[:300])
        return None, None


# ---------------------------------------------------------------------------------------------------


PREFILL_VARIANTS = {  # prep settings besides the default (head order, 16-row conv, 32-column gate, 2 warps)
    "tf32_products": dict(gram_precision="tf32", merge_precision="tf32", output_precision="tf32"),
}
# the recurrence's own settings were swept in KDA run 4 (3 stages best; 4 need 271 KB of shared memory)
# value tiles of 32 and 16 columns: 2x and 4x the programs, for a rank's few heads (8 heads, one sequence:
# 16 programs of 64 columns walk all the chunks on 16 of the GPU's SMs)
RECUR_VARIANTS: dict[str, dict] = {"bv32": dict(block_v=32), "bv16": dict(block_v=16)}
# FLA chunk_kda on an H100 by heads (RESULTS S44-1), for --skip-fla: not measured in the same run
FLA_PREFILL_RECORDED_US = {
    64: {"T4096": 1090.3, "T13312": 3389.6, "varlen2x6656": 3386.1},
    8: {"T4096": 2272.3, "T13312": 1196.4, "varlen2x6656": 1814.1},
}


def _warm_one(job: tuple[dict, int]) -> str:
    """Compile the prefill kernels for `tuning` and `n_seq` sequences (fills Triton's on-disk cache)."""
    tuning, n_seq = job
    t0 = time.time()
    lay = Layer(slots=n_seq, seed=0)
    cu, cu_d = offsets([70] * n_seq)
    slots = KDASlots(*lay.pools(), torch.arange(n_seq, device=DEV))
    chunk.prefill(KDAInputs(*lay.inputs(cu[-1])), lay.params(), slots, cu_d, cu, **tuning)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return f"{tuning} x{n_seq}: {time.time() - t0:.0f}s"


def warm_prefill_kernels(sweep: bool):
    """Start compiling every prefill kernel configuration the run will use, in parallel processes (the
    kernels are large; compiling them one after another would take minutes). Returns the pending jobs."""
    import concurrent.futures
    import multiprocessing

    jobs = [({}, n) for n in (1, 2, 4)]
    if sweep:
        jobs += [(t, n) for t in (*PREFILL_VARIANTS.values(), *RECUR_VARIANTS.values()) for n in (1, 4)]
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=min(len(jobs), max(1, (os.cpu_count() or 2) - 2)),
        mp_context=multiprocessing.get_context("spawn"),
    )
    return pool, [pool.submit(_warm_one, job) for job in jobs]


def parity_prefill(fla_chunk, variants: dict[str, dict]) -> None:
    """Varlen prefill with random slots against the fp32 reference: default settings and `variants`."""
    lay = Layer(slots=8, seed=1)
    lens = [L(1500), 1, 3, L(2600)]
    cu, cu_d = offsets(lens)
    x = KDAInputs(*lay.inputs(cu[-1]))
    q, k, v, f, b = x.tensors
    slots = torch.tensor([5, 0, 7, 2], device=DEV)
    c_ref, s_ref = lay.pools()
    o_ref = reference.prefill(x, lay.params(), KDASlots(c_ref, s_ref, slots), None, cu)
    for name, tuning in {"": {}, **variants}.items():
        tag = f"parity_prefill{'_' + name if name else ''}"
        c, s = lay.pools()
        o = chunk.prefill(x, lay.params(), KDASlots(c, s, slots), cu_d, cu, **tuning)
        rec(f"{tag}_o", err(o, o_ref))
        rec(f"{tag}_state", err(s[slots], s_ref[slots]))
        if not name:
            rec(f"{tag}_window_exact", bool(torch.equal(c, c_ref)))
            rec(f"{tag}_untouched_exact", bool(torch.equal(s[[1, 3, 4, 6]], lay.state_pool[[1, 3, 4, 6]])))
    if fla_chunk is not None and os.environ.get("KDA_BENCH_FLA_PARITY") == "1":
        # FLA on the same conv outputs, gate and β in its kernel
        y, _ = reference.causal_conv(
            torch.cat([q, k, v], -1)[None],
            lay.conv_pool[slots[:1]],
            lay.conv_weight,
            torch.tensor([cu[-1]], device=DEV),
        )
        qq, kk, vv = (t.unflatten(-1, (H, D)) for t in y.chunk(3, -1))
        o_f, s_f = fla_chunk(
            qq,
            kk,
            vv,
            f.unflatten(-1, (H, D))[None],
            b[None],
            A_log=lay.a_log,
            dt_bias=lay.dt_bias,
            initial_state=lay.state_pool[slots[:1]].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            lower_bound=LB,
        )
        c1, s1 = lay.pools()
        cu1, cu1_d = offsets([cu[-1]])
        o1 = chunk.prefill(x, lay.params(), KDASlots(c1, s1, slots[:1]), cu1_d, cu1)
        c2, s2 = lay.pools()
        o1_ref = reference.prefill(x, lay.params(), KDASlots(c2, s2, slots[:1]), None, cu1)
        rec("parity_prefill_fla_vs_ref_o", err(o_f[0], o1_ref))
        rec("parity_prefill_hylo_vs_ref_o_same_input", err(o1, o1_ref))
        rec("parity_prefill_fla_vs_ref_state", err(s_f[0], s2[slots[0]]))


def parity(fla_chunk, fla_rec) -> None:
    parity_prefill(fla_chunk, {})
    parity_steps()


def decode_operands(one, lay, conv, state, slots) -> tuple[KDAInputs, KDAParams, KDASlots]:
    """A decode step's typed operands from its inputs `one` (q, k, v, f, b of one token per sequence)."""
    return KDAInputs(*one), lay.params(), KDASlots(conv, state, slots)


def parity_steps() -> None:
    """Decode, verify (block and sequential kernels) and both commits against the fp32 reference, with
    random slots and random accepted counts (0 and T included); then the gated norm."""
    lay = Layer(slots=8, seed=1)
    bsz, t = 8, 8
    x = KDAInputs(*lay.inputs(bsz, t))
    slots = torch.randperm(8, device=DEV)
    c_ref, s_ref = lay.pools()
    one = [part[:, 0] for part in x.tensors]
    norm = OutputNorm(torch.randn_like(x.q[:, 0]).view(bsz, H, D), torch.randn(D, device=DEV), 1e-5)
    o_ref = reference.decode(*decode_operands(one, lay, c_ref, s_ref, slots), norm)
    c, s = lay.pools()
    o = recurrent.decode(*decode_operands(one, lay, c, s, slots), norm)
    rec("parity_decode_o", err(o, o_ref))
    rec("parity_decode_state", err(s, s_ref))
    rec("parity_decode_window_exact", bool(torch.equal(c, c_ref)))

    n_acc = torch.tensor([0, 8, 3, 1, 8, 5, 2, 7], device=DEV)
    steps_ref = torch.empty(bsz, t, H, D, D, device=DEV)
    c0, s0 = lay.pools()
    o_ref, cache_ref = reference.verify(x, lay.params(), KDASlots(c0, s0, slots), step_states=steps_ref)
    reference.commit(cache_ref, lay.params(), KDASlots(c0, s0, slots), n_acc)
    c, s = lay.pools()
    steps = torch.empty_like(steps_ref)
    o, seq_cache = recurrent.verify(x, lay.params(), KDASlots(c, s, slots), step_states=steps)
    rec("parity_verify_sequential_o", err(o, o_ref))
    rec("parity_verify_step_states", err(steps, steps_ref))
    o, cache = recurrent.verify(x, lay.params(), KDASlots(c, s, slots))
    rec("parity_verify_o", err(o, o_ref))
    rec(
        "parity_verify_pools_untouched",
        bool(torch.equal(c, lay.conv_pool) and torch.equal(s, lay.state_pool)),
    )
    recurrent.commit(cache, lay.params(), KDASlots(c, s, slots), n_acc)
    rec("parity_commit_state", err(s, s0))
    rec("parity_commit_window_exact", bool(torch.equal(c, c0)))
    rec("parity_commit_rejected_untouched", bool(torch.equal(s[slots[0]], lay.state_pool[slots[0]])))
    c, s = lay.pools()
    recurrent.commit(seq_cache, lay.params(), KDASlots(c, s, slots), n_acc)
    rec("parity_commit_sequential_state", err(s, s0))
    c, s = lay.pools()
    recurrent.commit_steps(seq_cache, steps, KDASlots(c, s, slots), n_acc)
    rec("parity_commit_steps_state", err(s, s0))
    for t in (16, 4, 1):  # other block lengths
        x = KDAInputs(*lay.inputs(bsz, t))
        n_acc = torch.randint(0, t + 1, (bsz,), device=DEV)
        c0, s0 = lay.pools()
        o_ref, cache_ref = reference.verify(x, lay.params(), KDASlots(c0, s0, slots))
        reference.commit(cache_ref, lay.params(), KDASlots(c0, s0, slots), n_acc)
        c, s = lay.pools()
        o, cache = recurrent.verify(x, lay.params(), KDASlots(c, s, slots))
        recurrent.commit(cache, lay.params(), KDASlots(c, s, slots), n_acc)
        rec(f"parity_verify_T{t}_o", err(o, o_ref))
        rec(f"parity_commit_T{t}_state", err(s, s0))
        rec(f"parity_commit_T{t}_window_exact", bool(torch.equal(c, c0)))
    o = torch.randn(L(4096), H, D, device=DEV).to(ACT)
    gate = torch.randn(L(4096), HD, device=DEV).to(ACT)
    wn = torch.randn(D, device=DEV)
    rec(
        "parity_norm",
        err(
            rmsnorm.gated_rms_norm(o, OutputNorm(gate, wn, 1e-5)),
            reference.gated_rms_norm(o, gate.view(-1, H, D), wn, 1e-5),
        ),
    )


# ---------------------------------------------------------------------------------------------------


def copy_ceiling() -> float:
    if DEV == "cpu":
        return 1.0
    x = torch.empty(1 << 30, device=DEV, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * (1 << 30) * 2 / (t * 1e-3) / 1e12


def kernel_registers() -> None:
    """Registers and spills of every compiled prefill kernel (ptxas's figures, from Triton's cache)."""
    if DEV == "cpu":
        return
    for kernel in (chunk._conv_gate_kernel, chunk._intra_kernel, chunk._recur_kernel):
        for i, compiled in enumerate(kernel.device_caches[torch.cuda.current_device()][0].values()):
            compiled._init_handles()
            rec(f"regs_{kernel.fn.__name__}_{i}", f"{compiled.n_regs} regs, {compiled.n_spills} spills")


def fla_prefill_kwargs(lay: Layer, lens: list[int]) -> dict:
    """FLA `chunk_kda`'s fastest path for this model: gate, β and L2 norm in-kernel, safe gate."""
    kw = dict(
        A_log=lay.a_log,
        dt_bias=lay.dt_bias,
        initial_state=lay.state_pool[: len(lens)].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=LB,
    )
    if len(lens) > 1:
        cu, cu_d = offsets(lens)
        kw.update(cu_seqlens=cu_d.long(), cu_seqlens_cpu=torch.tensor(cu))
    return kw


# issue 45 item 2 asks T = 8192 and 13312 (one sequence each)
PREFILL_CASES = {"T4096": [4096], "T8192": [8192], "T13312": [13312], "varlen2x6656": [6656, 6656]}


def warm_fla(fla_chunk) -> None:
    """FLA autotunes on its first calls: run them (fixed and varlen) before anything is timed."""
    for lens in ([L(4096)], [L(256), L(256)]):
        lay = Layer(slots=4, seed=2)
        q, k, v, f, b = (t[None] for t in lay.inputs(sum(lens)))
        fla_chunk(
            q.unflatten(-1, (H, D)),
            k.unflatten(-1, (H, D)),
            v.unflatten(-1, (H, D)),
            f.unflatten(-1, (H, D)),
            b,
            **fla_prefill_kwargs(lay, lens),
        )
    torch.cuda.synchronize()


def kernel_times(fn, tag: str) -> None:
    """Per-kernel GPU time of one call of `fn` (median of 5, from the profiler)."""
    if DEV == "cpu":
        return
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count >= 5:
            rec(f"{tag}_kernel_{event.key[:40]}_us", event.device_time_total / event.count)


def time_prefill(fla_chunk, quick: bool, skip_fla: bool = False) -> None:
    """hylo, then FLA `chunk_kda`, on the same inputs (hylo also runs the conv). Unless `quick`, the
    settings of PREFILL_VARIANTS are timed end to end on every case, and split into prep / recurrence
    (with RECUR_VARIANTS) on the single-sequence cases. `skip_fla`: FLA is not run; the ratios are taken
    against its figures recorded in an earlier run (keys `..._fla_us_recorded`, `..._ratio_recorded_fla`)."""
    inputs = {}
    for name, lens in PREFILL_CASES.items():
        lens = [L(n) for n in lens]
        lay = Layer(slots=4, seed=2)
        cu, cu_d = offsets(lens)
        x = KDAInputs(*lay.inputs(cu[-1]))
        inputs[name] = x.tensors
        slots = KDASlots(*lay.pools(), torch.arange(len(lens), device=DEV))
        args = (x, lay.params(), slots, cu_d, cu)
        rec(f"prefill_{name}_hylo_us", bench(lambda a=args: chunk.prefill(*a), graph=False))
        for var, tuning in {} if quick else PREFILL_VARIANTS.items():
            rec(
                f"prefill_{name}_{var}_us",
                bench(lambda a=args, t=tuning: chunk.prefill(*a, **t), graph=False),
            )
        kernel_times(lambda a=args: chunk.prefill(*a), f"prefill_{name}")
        for var, tuning in {} if quick else PREFILL_VARIANTS.items():
            kernel_times(lambda a=args, t=tuning: chunk.prefill(*a, **t), f"prefill_{name}_{var}")
        if len(lens) > 1:
            continue
        terms = chunk.prep(*args)
        o = torch.empty(cu[-1], H, D, dtype=x.q.dtype, device=DEV)
        rec(f"prefill_{name}_hylo_prep_us", bench(lambda a=args: chunk.prep(*a), graph=False))
        rec(
            f"prefill_{name}_hylo_recur_us",
            bench(lambda: chunk.recur(terms, o, slots, cu_d), graph=False),
        )
        for var, tuning in {} if quick else PREFILL_VARIANTS.items():
            if set(tuning) <= chunk.PREP_KEYS:
                rec(
                    f"prefill_{name}_prep_{var}_us",
                    bench(lambda a=args, t=tuning: chunk.prep(*a, **t), graph=False),
                )
        for var, tuning in {} if quick else RECUR_VARIANTS.items():
            rec(
                f"prefill_{name}_recur_{var}_us",
                bench(lambda t=tuning: chunk.recur(terms, o, slots, cu_d, **t), graph=False),
            )
        torch.cuda.empty_cache()
    kernel_registers()
    recorded = FLA_PREFILL_RECORDED_US.get(H, {}) if skip_fla else {}
    for name in (name for name in PREFILL_CASES if name in recorded):
        rec(f"prefill_{name}_fla_us_recorded", recorded[name])
        for var in ("hylo", *({} if quick else PREFILL_VARIANTS)):
            rec(f"prefill_{name}_{var}_ratio_recorded_fla", RES[f"prefill_{name}_{var}_us"] / recorded[name])
    for name, lens in PREFILL_CASES.items() if fla_chunk is not None and not skip_fla else ():
        lens = [L(n) for n in lens]
        lay = Layer(slots=4, seed=2)
        qq, kk, vv, ff = (t.view(1, -1, H, D) for t in inputs[name][:4])
        b = inputs[name][4][None]
        kw = fla_prefill_kwargs(lay, lens)
        rec(f"prefill_{name}_fla_us", bench(lambda kw=kw: fla_chunk(qq, kk, vv, ff, b, **kw), graph=False))
        for var in ("hylo", *({} if quick else PREFILL_VARIANTS)):
            rec(
                f"prefill_{name}_{var}_ratio", RES[f"prefill_{name}_{var}_us"] / RES[f"prefill_{name}_fla_us"]
            )


VERIFY_LAUNCH = {  # block-verify launch settings (BV, warps, key chunk) timed besides the default
    "bv64_w4_dc128": dict(block_v=64, num_warps=4, key_chunk=128),
    "bv128_w2_dc64": dict(block_v=128, num_warps=2, key_chunk=64),
    "bv128_w2_dc32": dict(block_v=128, num_warps=2, key_chunk=32),
}
COMMIT_LAUNCH = {  # rows of S per program, warps
    "bk16_w1": dict(block_k=16, num_warps=1),
    "bk16_w2": dict(block_k=16, num_warps=2),
    "bk16_w4": dict(block_k=16, num_warps=4),
    "bk32_w2": dict(block_k=32, num_warps=2),
    "bk32_w4": dict(block_k=32, num_warps=4),
    "bk64_w4": dict(block_k=64, num_warps=4),
}


def time_steps(fla_rec, ceiling: float, quick: bool) -> None:
    """Per batch size, under graph replay: decode T=1, verify T=8 and the commit of 8 accepted tokens
    (kernels alone, then with their conv launch), FLA's fused_recurrent_kda at T=1 and T=8 on the same
    conv outputs, and the per-step-state alternative (sequential verify writing 8 states, commit by copy)."""
    t = 8
    for bsz in (1, 8, 32, 128):
        lay = Layer(slots=bsz, seed=3)
        slots = torch.randperm(bsz, device=DEV)
        conv, state = lay.pools()
        pools, params = KDASlots(conv, state, slots), lay.params()
        state_bytes = bsz * H * D * D * 4
        n_all = torch.full((bsz,), t, device=DEV, dtype=torch.int32)
        x = KDAInputs(*lay.inputs(bsz, 1))
        qkv = recurrent.conv_steps(x, lay.conv_weight, pools)
        rec(
            f"decode_B{bsz}_hylo_us",
            bench(lambda: recurrent.recurrent(qkv, x, params, pools), graph=True),
        )
        rec(f"decode_B{bsz}_hylo_TBps", 2 * state_bytes / RES[f"decode_B{bsz}_hylo_us"] / 1e6)
        rec(f"decode_B{bsz}_hylo_frac_ceiling", RES[f"decode_B{bsz}_hylo_TBps"] / ceiling)
        one = [part[:, 0] for part in x.tensors]
        rec(
            f"decode_B{bsz}_hylo_with_conv_us",
            bench(lambda: recurrent.decode(*decode_operands(one, lay, conv, state, slots)), graph=True),
        )
        norm = OutputNorm(torch.randn_like(one[0]).view(bsz, H, D), torch.randn(D, device=DEV), 1e-5)
        rec(  # the decode of a layer: the step with its conv, then the output norm with the window step
            f"decode_B{bsz}_hylo_with_conv_norm_us",
            bench(lambda: recurrent.decode(*decode_operands(one, lay, conv, state, slots), norm), graph=True),
        )
        fla_timing(fla_rec, f"decode_B{bsz}", qkv, x, lay)

        x = KDAInputs(*lay.inputs(bsz, t))
        qkv = recurrent.conv_steps(x, lay.conv_weight, pools)
        rec(
            f"verify_B{bsz}_hylo_us",
            bench(lambda: recurrent.block_verify(qkv, x, params, pools), graph=True),
        )
        for name, launch in {} if quick else VERIFY_LAUNCH.items():
            rec(
                f"verify_B{bsz}_{name}_us",
                bench(lambda: recurrent.block_verify(qkv, x, params, pools, **launch), graph=True),
            )
        rec(
            f"verify_B{bsz}_hylo_with_conv_us",
            bench(lambda: recurrent.verify(x, params, pools), graph=True),
        )
        fla_timing(fla_rec, f"verify_B{bsz}", qkv, x, lay)
        _, replay = recurrent.block_verify(qkv, x, params, pools)
        verified = recurrent.ReplayCache(x, replay=replay)
        rec(
            f"commit8_B{bsz}_hylo_us",
            bench(lambda: recurrent.block_commit(verified, params, pools, n_all), graph=True),
        )
        for name, launch in {} if quick else COMMIT_LAUNCH.items():
            rec(
                f"commit8_B{bsz}_{name}_us",
                bench(lambda: recurrent.block_commit(verified, params, pools, n_all, **launch), graph=True),
            )
        rec(f"commit8_B{bsz}_TBps", 2 * state_bytes / RES[f"commit8_B{bsz}_hylo_us"] / 1e6)
        if bsz <= 32:
            steps = torch.empty(bsz, t, H, D, D, device=DEV)
            rec(
                f"verify_steps_B{bsz}_hylo_us",
                bench(
                    lambda: recurrent.recurrent(qkv, x, params, pools, store_state=False, step_states=steps),
                    graph=True,
                ),
            )
            cache = reference.VerifyCache(x, qkv)
            rec(
                f"commit_steps_B{bsz}_hylo_us",
                bench(lambda: recurrent.commit_steps(cache, steps, pools, n_all), graph=True),
            )
            del steps
        if bsz in (8, 32):  # a DFlash-sized block of 16 tokens
            x = KDAInputs(*lay.inputs(bsz, 16))
            qkv = recurrent.conv_steps(x, lay.conv_weight, pools)
            for name, launch in {"": {}, **({} if quick else VERIFY_LAUNCH)}.items():
                rec(
                    f"verify16_B{bsz}{'_' + name if name else '_hylo'}_us",
                    bench(lambda: recurrent.block_verify(qkv, x, params, pools, **launch), graph=True),
                )
            _, replay = recurrent.block_verify(qkv, x, params, pools)
            verified = recurrent.ReplayCache(x, replay=replay)
            n16 = torch.full((bsz,), 16, device=DEV, dtype=torch.int32)
            rec(
                f"commit16_B{bsz}_hylo_us",
                bench(lambda: recurrent.block_commit(verified, params, pools, n16), graph=True),
            )
            fla_timing(fla_rec, f"verify16_B{bsz}", qkv, x, lay)
        if fla_rec is not None:
            rec(f"decode_B{bsz}_ratio_fla", RES[f"decode_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_fla_us"])
            rec(f"verify_B{bsz}_ratio_fla", RES[f"verify_B{bsz}_hylo_us"] / RES[f"verify_B{bsz}_fla_us"])
        rec(f"verify_B{bsz}_ratio_decode", RES[f"verify_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_hylo_us"])
        rec(f"commit8_B{bsz}_ratio_decode", RES[f"commit8_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_hylo_us"])
        time_layer_sweep(bsz, lay, slots, t)
        torch.cuda.empty_cache()
    rec("replay_MiB_per_request_layer", 3 * t * HD * 4 / 2**20)
    rec("step_states_MiB_per_request_layer", t * H * D * D * 4 / 2**20)


def time_layer_sweep(bsz: int, lay: Layer, slots: torch.Tensor, t: int) -> None:
    """Decode, verify and commit as a model step runs them: each launch on another layer's pools (the model
    has 34 KDA layers, each with its own), so the state comes from HBM. Replaying one pool, as above, keeps
    up to 50 MB of state in L2 between launches (decode at B=8 then beats the HBM bandwidth). Per-launch
    median of a graph of launches over `layers` pools (together ≥ 256 MiB, at most 34)."""
    state_bytes = bsz * H * D * D * 4
    layers = min(34, max(2, -(-(256 << 20) // state_bytes)))
    pools = [lay.pools() for _ in range(layers)]
    params = lay.params()
    n_all = torch.full((bsz,), t, device=DEV, dtype=torch.int32)

    def sweep(fn) -> float:
        return bench(lambda: [fn(KDASlots(conv, state, slots)) for conv, state in pools], graph=True) / layers

    x = KDAInputs(*lay.inputs(bsz, 1))
    qkv = recurrent.conv_steps(x, lay.conv_weight, KDASlots(*pools[0], slots))
    one = KDAInputs(*(part[:, 0] for part in x.tensors))
    decode = sweep(lambda layer: recurrent.recurrent(qkv, x, params, layer))
    rec(f"decode_B{bsz}_layers_us", decode)
    rec(f"decode_B{bsz}_layers_TBps", 2 * state_bytes / decode / 1e6)
    rec(
        f"decode_B{bsz}_layers_with_conv_us",
        sweep(lambda layer: recurrent.decode(one, params, layer)),
    )
    x = KDAInputs(*lay.inputs(bsz, t))
    qkv = recurrent.conv_steps(x, lay.conv_weight, KDASlots(*pools[0], slots))
    rec(
        f"verify_B{bsz}_layers_us",
        sweep(lambda layer: recurrent.block_verify(qkv, x, params, layer)),
    )
    _, replay = recurrent.block_verify(qkv, x, params, KDASlots(*pools[0], slots))
    verified = recurrent.ReplayCache(x, replay=replay)
    commit = sweep(lambda layer: recurrent.block_commit(verified, params, layer, n_all))
    rec(f"commit8_B{bsz}_layers_us", commit)
    rec(f"commit8_B{bsz}_layers_ratio_decode", commit / decode)
    rec(f"layers_B{bsz}", layers)


def fla_timing(fla_rec, tag: str, qkv, x: KDAInputs, lay: Layer) -> None:
    """FLA's fused_recurrent_kda (gate, β and L2 norm in-kernel, safe gate) on the same conv outputs and
    the gates of `x`."""
    if fla_rec is None:
        return
    qq, kk, vv = (part.unflatten(-1, (H, D)).contiguous() for part in qkv.chunk(3, -1))
    ff, b = x.f.unflatten(-1, (H, D)), x.b
    h0 = lay.state_pool.clone()
    kw = dict(
        A_log=lay.a_log,
        dt_bias=lay.dt_bias,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=LB,
    )
    rec(f"{tag}_fla_us", bench(lambda: fla_rec(qq, kk, vv, ff, b, **kw), graph=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the tuning sweeps")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument(
        "--skip-fla",
        action="store_true",
        help="prefill: neither warm up nor time FLA's chunk_kda; compare with its recorded figures",
    )
    ap.add_argument(
        "--only", choices=["prefill", "step"], help="run one kernel family: its parity, then its timings"
    )
    args = ap.parse_args()
    t0 = time.time()
    rec("torch", torch.__version__)
    rec("triton", triton.__version__)
    rec("gpu", torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)")
    fla_chunk, fla_rec = fla_api()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [("copy", lambda: rec("copy_TBps", copy_ceiling()))]
    if not args.skip_parity:
        sections.insert(0, ("parity", lambda: parity(fla_chunk, fla_rec)))
    sections += [
        ("prefill", lambda: time_prefill(fla_chunk, args.quick, args.skip_fla)),
        ("steps", lambda: time_steps(fla_rec, RES.get("copy_TBps", 4.27), args.quick)),
    ]
    if args.only == "prefill":
        variants = {} if args.quick else {**PREFILL_VARIANTS, **RECUR_VARIANTS}
        warm = warm_prefill_kernels(not args.quick) if DEV == "cuda" else None
        warm_needed = fla_chunk is not None and not args.skip_fla
        sections = [("fla_warmup", lambda: warm_fla(fla_chunk))] if warm_needed else []
        sections += [("compile", lambda: [rec("compiled", job.result()) for job in warm[1]])] * (
            warm is not None
        )
        sections += [("parity", lambda: parity_prefill(fla_chunk, variants))] * (not args.skip_parity)
        sections += [("prefill", lambda: time_prefill(fla_chunk, args.quick, args.skip_fla))]
    if args.only == "step":
        sections = [("parity", parity_steps)] * (not args.skip_parity)
        sections += [
            ("copy", lambda: rec("copy_TBps", copy_ceiling())),
            ("steps", lambda: time_steps(fla_rec, RES.get("copy_TBps", 4.27), args.quick)),
        ]
    for name, run in sections:
        t1 = time.time()
        try:
            run()
        except Exception:  # keep the other sections' figures
            rec(f"{name}_error", traceback.format_exc()[-1500:])
        rec(f"{name}_wall_s", time.time() - t1)
        (out / "kda.json").write_text(json.dumps(RES, indent=1))
    rec("wall_s", time.time() - t0)
    (out / "kda.json").write_text(json.dumps(RES, indent=1))
    print("\n| figure | value |\n| --- | --- |")
    for key, val in RES.items():
        swept = "_bv" in key or "_bk" in key
        if any(s in key for s in ("parity", "_us", "ratio", "TBps", "frac", "regs")) and not swept:
            print(f"| {key} | {val:.4g} |" if isinstance(val, float) else f"| {key} | {val} |")


if __name__ == "__main__":
    main()
