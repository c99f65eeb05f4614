"""One launch of each KDA kernel at GLM-5.3-Flash shapes, for Nsight Compute to profile.

    ncu --clock-control none -k regex:'_conv_gate|_intra|_recur|_block_' --section SpeedOfLight \
        python3 benchmarks/device/kda_profile.py

Prefill of 13312 tokens (the three launches), as one sequence and as two, block verify T=8 at B=8, the
commit of 8 tokens at B=32 and decode at B=32: each is run once so that every profiled launch is a kernel
that has compiled.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import kda as bench  # registers hylo.ops.kda without the engine

from hylo.ops.kda import chunk, recurrent


def main() -> None:
    lay = bench.Layer(slots=32, seed=1)
    conv, state = lay.pools()
    q, k, v, f, b = lay.inputs(13312)
    cu, cu_d = bench.offsets([13312])
    slots = torch.arange(1, device="cuda")
    chunk.prefill(q, k, v, f, b, *lay.params(), conv, state, slots, cu_d, cu, bench.LB)
    cu, cu_d = bench.offsets([6656, 6656])
    slots = torch.arange(2, device="cuda")
    chunk.prefill(q, k, v, f, b, *lay.params(), conv, state, slots, cu_d, cu, bench.LB)
    for bsz, t in ((8, 8), (32, 8), (32, 1)):
        slots = torch.randperm(bsz, device="cuda")
        q, k, v, f, b = lay.inputs(bsz, t)
        qkv = recurrent.conv_steps(q, k, v, lay.conv_weight, conv, slots)
        if t == 1:
            recurrent.recurrent(qkv, f, b, lay.dt_bias, lay.a_log, state, slots, bench.LB)
            continue
        _, replay = recurrent.block_verify(qkv, f, b, lay.dt_bias, lay.a_log, state, slots, bench.LB)
        n = torch.full((bsz,), t, device="cuda", dtype=torch.int32)
        recurrent.block_commit(replay, q, k, v, conv, state, slots, n, bench.LB)
    torch.cuda.synchronize()
    print("ran", flush=True)


if __name__ == "__main__":
    main()
