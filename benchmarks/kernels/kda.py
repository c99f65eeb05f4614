# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""KDA kernels on the GPU: real-shape parity, then hylo vs FLA timings on the same inputs (one run).

GLM-5.3-Flash shapes: 64 heads, d = 128, bf16 activations, fp32 state. Usage (FLA optional):

    PYTHONPATH=src python benchmarks/kernels/kda.py [--quick] [--out DIR]

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
from hylo.ops.kda import chunk, recurrent, reference, rmsnorm  # noqa: E402

H, D, W, LB = 64, 128, 4, -5.0
DEV = "cuda"
if os.environ.get("KDA_BENCH_DRY") == "1":  # a CPU walk-through of the script under TRITON_INTERPRET=1
    H, D, DEV = 2, 16, "cpu"
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
        self.conv_pool = torch.randn(slots, W - 1, 3 * HD, device=DEV, generator=g).bfloat16()
        self.state_pool = torch.randn(slots, H, D, D, device=DEV, generator=g) * 0.05

    def inputs(self, *lead):
        r = [torch.randn(*lead, HD, device=DEV, generator=self.gen).bfloat16() for _ in range(4)]
        return [*r, torch.randn(*lead, H, device=DEV, generator=self.gen).bfloat16()]

    def params(self):
        return self.conv_weight, self.dt_bias, self.a_log

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


def parity(fla_chunk, fla_rec) -> None:
    lay = Layer(slots=8, seed=1)
    lens = [L(1500), 1, 3, L(2600)]
    cu, cu_d = offsets(lens)
    q, k, v, f, b = lay.inputs(cu[-1])
    slots = torch.tensor([5, 0, 7, 2], device=DEV)
    c_ref, s_ref = lay.pools()
    o_ref = reference.prefill(q, k, v, f, b, *lay.params(), c_ref, s_ref, slots, None, cu, LB)
    c, s = lay.pools()
    o = chunk.prefill(q, k, v, f, b, *lay.params(), c, s, slots, cu_d, cu, LB)
    rec("parity_prefill_o", err(o, o_ref))
    rec("parity_prefill_state", err(s[slots], s_ref[slots]))
    rec("parity_prefill_window_exact", bool(torch.equal(c, c_ref)))
    rec("parity_prefill_untouched_exact", bool(torch.equal(s[[1, 3, 4, 6]], lay.state_pool[[1, 3, 4, 6]])))
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
        o1 = chunk.prefill(q, k, v, f, b, *lay.params(), c1, s1, slots[:1], cu1_d, cu1, LB)
        c2, s2 = lay.pools()
        o1_ref = reference.prefill(q, k, v, f, b, *lay.params(), c2, s2, slots[:1], None, cu1, LB)
        rec("parity_prefill_fla_vs_ref_o", err(o_f[0], o1_ref))
        rec("parity_prefill_hylo_vs_ref_o_same_input", err(o1, o1_ref))
        rec("parity_prefill_fla_vs_ref_state", err(s_f[0], s2[slots[0]]))

    bsz, t = 8, 8
    q, k, v, f, b = lay.inputs(bsz, t)
    slots = torch.randperm(8, device=DEV)
    c_ref, s_ref = lay.pools()
    o_ref = reference.decode(
        q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], *lay.params(), c_ref, s_ref, slots, LB
    )
    c, s = lay.pools()
    o = recurrent.decode(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], *lay.params(), c, s, slots, LB)
    rec("parity_decode_o", err(o, o_ref))
    rec("parity_decode_state", err(s, s_ref))
    rec("parity_decode_window_exact", bool(torch.equal(c, c_ref)))

    steps_ref = torch.empty(bsz, t, H, D, D, device=DEV)
    c0, s0 = lay.pools()
    o_ref, cache_ref = reference.verify(
        q, k, v, f, b, *lay.params(), c0, s0, slots, LB, step_states=steps_ref
    )
    c, s = lay.pools()
    steps = torch.empty_like(steps_ref)
    o, cache = recurrent.verify(q, k, v, f, b, *lay.params(), c, s, slots, LB, step_states=steps)
    rec("parity_verify_sequential_o", err(o, o_ref))
    o1, _ = recurrent.verify(q, k, v, f, b, *lay.params(), c, s, slots, LB)
    rec("parity_verify_o", err(o1, o_ref))
    rec("parity_verify_step_states", err(steps, steps_ref))
    rec(
        "parity_verify_pools_untouched",
        bool(torch.equal(c, lay.conv_pool) and torch.equal(s, lay.state_pool)),
    )
    n_acc = torch.randint(0, t + 1, (bsz,), device=DEV)
    reference.commit(cache_ref, *lay.params(), c0, s0, slots, n_acc, LB)
    recurrent.commit(cache, *lay.params(), c, s, slots, n_acc, LB)
    rec("parity_commit_state", err(s, s0))
    rec("parity_commit_window_exact", bool(torch.equal(c, c0)))
    c, s = lay.pools()
    recurrent.commit_steps(cache, steps, c, s, slots, n_acc)
    rec("parity_commit_steps_state", err(s, s0))
    x = torch.randn(L(4096), H, D, device=DEV).bfloat16()
    gate = torch.randn(L(4096), HD, device=DEV).bfloat16()
    wn = torch.randn(D, device=DEV)
    rec(
        "parity_norm",
        err(
            rmsnorm.gated_rms_norm(x, gate, wn, 1e-5),
            reference.gated_rms_norm(x, gate.view(-1, H, D), wn, 1e-5),
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


def time_prefill(fla_chunk, quick: bool) -> None:
    cases = {"T4096": [L(4096)], "T13312": [L(13312)], "varlen2x6656": [L(6656), L(6656)]}
    for name, lens in cases.items():
        lay = Layer(slots=4, seed=2)
        cu, cu_d = offsets(lens)
        q, k, v, f, b = lay.inputs(cu[-1])
        slots = torch.arange(len(lens), device=DEV)
        conv, state = lay.pools()
        args = (q, k, v, f, b, *lay.params(), conv, state, slots, cu_d, cu, LB)
        rec(f"prefill_{name}_hylo_us", bench(lambda a=args: chunk.prefill(*a), graph=False))
        if name == "T4096":
            pargs = (q, k, v, f, b, *lay.params(), conv, slots, cu_d, cu, LB, H)
            bufs = chunk.prep(*pargs)
            rec(f"prefill_{name}_hylo_prep_us", bench(lambda: chunk.prep(*pargs), graph=False))
            rec(
                f"prefill_{name}_hylo_recur_us",
                bench(lambda: chunk.recur(bufs, state, slots, cu_d), graph=False),
            )
            if not quick:
                rec(
                    f"prefill_{name}_prep_dh64_us",
                    bench(lambda: chunk.prep(*pargs, col_block=64), graph=False),
                )
        if fla_chunk is not None:
            qq, kk, vv = (t.view(1, -1, H, D) for t in (q, k, v))
            ff, bb = f.view(1, -1, H, D), b.view(1, -1, H)
            h0 = lay.state_pool[: len(lens)].clone()
            kw = dict(
                A_log=lay.a_log,
                dt_bias=lay.dt_bias,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                safe_gate=True,
                lower_bound=LB,
            )
            if len(lens) > 1:
                kw.update(cu_seqlens=cu_d.long(), cu_seqlens_cpu=torch.tensor(cu))
            rec(
                f"prefill_{name}_fla_us",
                bench(lambda kw=kw: fla_chunk(qq, kk, vv, ff, bb, **kw), graph=False),
            )
            rec(f"prefill_{name}_ratio", RES[f"prefill_{name}_hylo_us"] / RES[f"prefill_{name}_fla_us"])
        torch.cuda.empty_cache()


def time_steps(fla_rec, ceiling: float, quick: bool) -> None:
    for bsz in (1, 8, 32, 128):
        lay = Layer(slots=bsz, seed=3)
        slots = torch.randperm(bsz, device=DEV)
        conv, state = lay.pools()
        state_bytes = bsz * H * D * D * 4
        n_all = torch.full((bsz,), 8, device=DEV, dtype=torch.int32)
        dt, al = lay.dt_bias, lay.a_log
        for t in (1, 8):
            q, k, v, f, b = lay.inputs(bsz, t)
            qkv = recurrent.conv_steps(q, k, v, lay.conv_weight, conv, slots)
            tag = "decode" if t == 1 else "verify"
            if t == 1:
                rec(
                    f"decode_B{bsz}_hylo_us",
                    bench(lambda: recurrent.recurrent(qkv, f, b, dt, al, state, slots, LB), graph=True),
                )
                rec(f"decode_B{bsz}_hylo_TBps", 2 * state_bytes / RES[f"decode_B{bsz}_hylo_us"] / 1e6)
                rec(f"decode_B{bsz}_hylo_frac_ceiling", RES[f"decode_B{bsz}_hylo_TBps"] / ceiling)
                rec(
                    f"decode_B{bsz}_hylo_with_conv_us",
                    bench(
                        lambda: recurrent.decode(
                            q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], *lay.params(), conv, state, slots, LB
                        ),
                        graph=True,
                    ),
                )
            else:
                rec(
                    f"verify_B{bsz}_hylo_us",
                    bench(lambda: recurrent.one_chunk(qkv, f, b, dt, al, state, slots, LB), graph=True),
                )
                rec(
                    f"verify_B{bsz}_hylo_with_conv_us",
                    bench(
                        lambda: recurrent.verify(q, k, v, f, b, *lay.params(), conv, state, slots, LB),
                        graph=True,
                    ),
                )
                if bsz <= 8 and not quick:
                    rec(
                        f"verify_B{bsz}_hylo_bv32_us",
                        bench(
                            lambda: recurrent.one_chunk(qkv, f, b, dt, al, state, slots, LB, block_v=32),
                            graph=True,
                        ),
                    )
                rec(
                    f"verify_B{bsz}_sequential_us",
                    bench(
                        lambda: recurrent.recurrent(qkv, f, b, dt, al, state, slots, LB, store_state=False),
                        graph=True,
                    ),
                )
                _, cache = recurrent.verify(q, k, v, f, b, *lay.params(), conv, state, slots, LB)
                rec(
                    f"commit8_B{bsz}_hylo_us",
                    bench(
                        lambda: recurrent.one_chunk(
                            qkv,
                            f,
                            b,
                            dt,
                            al,
                            state,
                            slots,
                            LB,
                            write_o=False,
                            store_state=True,
                            n_steps=n_all,
                        ),
                        graph=True,
                    ),
                )
                rec(
                    f"commit8_B{bsz}_hylo_with_window_us",
                    bench(
                        lambda: recurrent.commit(cache, *lay.params(), conv, state, slots, n_all, LB),
                        graph=True,
                    ),
                )
                rec(
                    f"commit8_B{bsz}_sequential_us",
                    bench(
                        lambda: recurrent.recurrent(
                            qkv, f, b, dt, al, state, slots, LB, write_o=False, n_steps=n_all
                        ),
                        graph=True,
                    ),
                )
                if bsz <= 32:
                    steps = torch.empty(bsz, t, H, D, D, device=DEV)
                    rec(
                        f"verify_steps_B{bsz}_hylo_us",
                        bench(
                            lambda: recurrent.recurrent(
                                qkv, f, b, dt, al, state, slots, LB, store_state=False, step_states=steps
                            ),
                            graph=True,
                        ),
                    )
                    rec(
                        f"commit_steps_B{bsz}_hylo_us",
                        bench(
                            lambda: recurrent.commit_steps(cache, steps, conv, state, slots, n_all),
                            graph=True,
                        ),
                    )
                    del steps
            if fla_rec is not None:
                qq, kk, vv = (x.unflatten(-1, (H, D)).contiguous() for x in qkv.chunk(3, -1))
                ff = f.unflatten(-1, (H, D))
                h0 = lay.state_pool.clone()
                rec(
                    f"{tag}_B{bsz}_fla_us",
                    bench(
                        lambda: fla_rec(
                            qq,
                            kk,
                            vv,
                            ff,
                            b,
                            A_log=al,
                            dt_bias=dt,
                            initial_state=h0,
                            output_final_state=True,
                            use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True,
                            lower_bound=LB,
                        ),
                        graph=True,
                    ),
                )
        if fla_rec is not None:
            rec(f"decode_B{bsz}_ratio_fla", RES[f"decode_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_fla_us"])
            rec(f"verify_B{bsz}_ratio_fla", RES[f"verify_B{bsz}_hylo_us"] / RES[f"verify_B{bsz}_fla_us"])
        rec(f"verify_B{bsz}_ratio_decode", RES[f"verify_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_hylo_us"])
        rec(f"commit8_B{bsz}_ratio_decode", RES[f"commit8_B{bsz}_hylo_us"] / RES[f"decode_B{bsz}_hylo_us"])
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the tuning sweeps")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--skip-parity", action="store_true")
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
        ("prefill", lambda: time_prefill(fla_chunk, args.quick)),
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
        if any(s in key for s in ("parity", "_us", "ratio", "TBps", "frac")) and "_bv" not in key:
            print(f"| {key} | {val:.4g} |" if isinstance(val, float) else f"| {key} | {val} |")


if __name__ == "__main__":
    main()
