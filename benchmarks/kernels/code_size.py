"""Registers, spilled bytes and SASS instructions of the decode step's Triton kernels (and the verify step's
KDA block verify) at GLM-5.3-Flash's shapes, compiled for sm_90a on any machine (no GPU: Triton's bundled
ptxas and cuobjdump).

    PYTHONPATH=src python3 benchmarks/kernels/code_size.py [--kda-heads 64] [--json PATH]

A decode step runs each kernel once per layer, with its code evicted from L2 by the step's weights, so
a kernel's length costs instruction fetches in the step that a warm microbenchmark never shows: the MoE
prologue at 8 tokens took 34 us a call in the H100 replay against 15 alone while it was 7.2k
instructions (its token and arg-max loops unrolled), 17 us at 3.0k (RESULTS S33-2). Spilled registers
cost local-memory traffic (the KDA step's 16-wide tiles of 2 warps spilled 200 bytes a thread, S33-2).

Each case calls the kernel family's launch function with CPU tensors of the real shapes (the slice's
B = 1 and B = 8 decode batches, as a programmatic dependent as on Hopper); `JITFunction.run` is replaced
so that each launch is compiled as Triton would compile it for the GPU (the same specialisation of the
arguments: alignment, divisibility, constexprs and launch options) and not run. Run it in a process
whose kernels are not interpreted (no TRITON_INTERPRET).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

HEADS, HEAD_DIM, HIDDEN = 64, 128, 4096  # KDA heads, their width, the hidden size
EXPERTS, TOP_K = 288, 8
KPOOL, INDEX_DIM = 16, 128
TARGET = ("cuda", 90, 32)


def cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/")  # a SASS line: its address, then the instruction


def _cuobjdump(flag: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), flag, f.name], capture_output=True, text=True, check=True).stdout


@functools.lru_cache(maxsize=4)
def sass_instructions(cubin: bytes) -> tuple[str, ...]:
    """The SASS instruction lines of a compiled kernel, each with its address (cached: `resources` and
    `sass.py`'s fingerprint read the same kernel's)."""
    return tuple(line for line in _cuobjdump("-sass", cubin).splitlines() if INSTRUCTION.match(line))


def resources(cubin: bytes) -> dict[str, int]:
    """Registers a thread, stack bytes a thread (spills) and SASS instructions of one compiled kernel."""
    usage = _cuobjdump("-res-usage", cubin)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count:\n{usage}")
    return {
        "registers": int(found[1]),
        "stack_bytes": int(found[2]),
        "instructions": len(sass_instructions(cubin)),
    }


def compiled_launches(call: Callable[[], object], with_ptx: bool = False) -> list[dict[str, object]]:
    """Every Triton launch `call` makes, compiled for `TARGET` instead of run: kernel name, launch
    options, `resources` and whether its PTX waits on the launch before it and releases the next (and
    with `with_ptx` the PTX itself)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    launches: list[dict[str, object]] = []

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, _ = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, None)
        kernel = compile(
            ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        ptx = kernel.asm["ptx"]
        launches.append(
            {
                "kernel": self.fn.__name__,
                "num_warps": options.num_warps,
                **resources(kernel.asm["cubin"]),
                "waits": "griddepcontrol.wait" in ptx,  # a programmatic dependent (`ops.dependent_launch`)
                "releases": "griddepcontrol.launch_dependents" in ptx,
                **({"ptx": ptx} if with_ptx else {}),
            }
        )

    original = JITFunction.run
    JITFunction.run = compile_instead
    try:
        call()
    finally:
        JITFunction.run = original
    return launches


def _as_dependents(*modules) -> None:
    """Launch as on Hopper: the kernels' PDL variant (a device-side wait and trigger)."""
    for module in modules:
        module.dependent_launches = lambda device: True


def kda_operands(batch: int, heads: int, t: int = 1, low_rank: bool = True) -> tuple:
    """Zero operands (inputs, params, slots, output norm) of a KDA step: `t` tokens a sequence (decode's
    `[B, H·d]` rows at t = 1), as an FP8 checkpoint's decode passes them (f and the norm's gate as low-rank
    factors, β from the layer input and b_proj's rows) or with dense gates (a verify step's)."""
    from hylo.ops.kda.reference import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm

    hd, bf16 = heads * HEAD_DIM, torch.bfloat16

    def factor() -> LowRank:
        weight = torch.zeros(hd, HEAD_DIM, dtype=torch.float8_e4m3fn)
        return LowRank(torch.zeros(batch, HEAD_DIM, dtype=bf16), weight, torch.ones(hd // 128, 1))

    lead = (batch,) if t == 1 else (batch, t)
    q, k, v = torch.zeros(*lead, 3 * hd, dtype=bf16).split(hd, dim=-1)
    if low_rank:
        f = factor()
        b = LowRank(torch.zeros(batch, HIDDEN, dtype=bf16), torch.zeros(heads, HIDDEN, dtype=bf16))
    else:
        f, b = torch.zeros(*lead, hd, dtype=bf16), torch.zeros(*lead, heads, dtype=bf16)
    params = KDAParams(torch.zeros(3 * hd, 4), torch.zeros(hd), torch.zeros(heads), -5.0)
    slots = KDASlots(
        torch.zeros(batch + 1, 3, 3 * hd, dtype=bf16),
        torch.zeros(batch + 1, heads, HEAD_DIM, HEAD_DIM),
        torch.arange(batch, dtype=torch.int32),
    )
    gate = factor() if low_rank else torch.zeros(batch, hd, dtype=bf16)
    return KDAInputs(q, k, v, f, b), params, slots, OutputNorm(gate, torch.ones(HEAD_DIM, dtype=bf16), 1e-5)


def kda_step(batch: int, heads: int) -> Callable[[], object]:
    """The KDA decode step of an FP8 checkpoint (`recurrent.decode`: the step, then the gated output
    norm): conv inside, f and the norm's gate from their low-rank factors, β from the layer input and
    b_proj's rows."""
    from hylo.ops.kda import recurrent, rmsnorm

    operands = kda_operands(batch, heads)
    _as_dependents(recurrent, rmsnorm)
    return lambda: recurrent.decode(*operands)


def kda_verify(batch: int, tokens: int) -> Callable[[], object]:
    """The KDA block verify of a speculative step (`recurrent.block_verify`: `tokens` a request, dense gates
    as the verify step passes them) at the default launch for its batch and tokens."""
    from hylo.ops.kda import recurrent

    x, params, slots, _ = kda_operands(batch, HEADS, tokens, low_rank=False)
    qkv = torch.zeros(batch, tokens, 3 * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    return lambda: recurrent.block_verify(qkv, x, params, slots)


def moe_prologue(tokens: int) -> Callable[[], object]:
    """The MoE decode prologue: router logits, x's FP8 groups, routing and alignment with the shared
    expert, as a decode step launches it."""
    from hylo.ops.moe import decode, kernels
    from hylo.ops.moe.reference import Routing

    routing = Routing(
        torch.zeros(EXPERTS, HIDDEN, dtype=torch.bfloat16), torch.zeros(EXPERTS), TOP_K, 1, 1, True, 2.5
    )
    x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    block_m = kernels.default_config(tokens * TOP_K, EXPERTS, True).block_m
    _as_dependents(decode)
    return lambda: decode.prologue(x, routing, block_m, True, shared=True)


def moe_experts(
    tokens: int, ranks: int = 1, fp8: bool = True, shared_width: int | None = None, general: bool = False
) -> Callable[[], object]:
    """A MoE layer's routed experts with the shared expert at decode (`decode.routed_experts`: the
    prologue, gate|up with the activation, down with the combine), FP8 or bf16 weights (allocated, never
    read); `ranks` > 1: rank 0 of that many splitting the experts by expert and the shared expert by
    tensor (at 8, one token splits the gate|up K and the shared expert is an eighth as wide).
    `shared_width`: the shared expert's intermediate instead (0: none); `general`: the general path's
    experts (`kernels.experts`) on fixed choices instead of the decode path."""
    from hylo.ops.moe import decode, kernels
    from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert

    inter, local = 2048, EXPERTS // ranks
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def scales(n: int, k: int, *experts: int) -> torch.Tensor | None:
        return torch.empty(*experts, n // 128, k // 128) if fp8 else None

    routing = Routing(
        torch.empty(EXPERTS, HIDDEN, dtype=torch.bfloat16), torch.zeros(EXPERTS), TOP_K, 1, 1, True, 2.5
    )
    both = (scales(2 * inter, HIDDEN, local), scales(HIDDEN, inter, local))
    weights = ExpertWeights(
        torch.empty(local, 2 * inter, HIDDEN, dtype=dtype),
        torch.empty(local, HIDDEN, inter, dtype=dtype),
        both if fp8 else None,
    )
    width = inter // ranks if shared_width is None else shared_width
    shared = None
    if width:
        shared = SharedExpert(
            torch.empty(2 * width, HIDDEN, dtype=dtype),
            torch.empty(HIDDEN, width, dtype=dtype),
            (scales(2 * width, HIDDEN), scales(HIDDEN, width)) if fp8 else None,
        )
    x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    _as_dependents(decode, decode.kernels)
    if general:
        choices = Choices(torch.zeros(tokens, TOP_K, dtype=torch.int64), torch.ones(tokens, TOP_K))
        return lambda: kernels.experts(x, weights, choices, 10.0)
    first = None if ranks == 1 else 0
    return lambda: decode.routed_experts(x, routing, weights, 10.0, first_expert=first, shared=shared)


def mhc_entry(tokens: int) -> Callable[[], object]:
    """Entering a block under the decode plan (`mhc_enter`): the previous block's post mixed into the
    projection launch, the block's RMSNorm in the finishing launch."""
    from hylo.ops.mhc import kernels
    from hylo.ops.mhc.reference import BlockNorm, HCParams, PendingPost

    streams, n = torch.zeros(tokens, 4, HIDDEN, dtype=torch.bfloat16), 4
    hc = HCParams(
        torch.zeros((2 + n) * n, n * HIDDEN), torch.zeros((2 + n) * n), torch.ones(3), 1e-6, 1e-6, 20
    )
    pending = PendingPost(
        torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16), torch.zeros(tokens, n), torch.zeros(tokens, n, n)
    )
    norm = BlockNorm(torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-5)
    _as_dependents(kernels)
    return lambda: kernels.mhc_enter(streams, hc, pending, norm)


def pool_compression() -> Callable[[], object]:
    """The indexer's compression of one completed pool (a decode step of one sequence), FP8 pooled keys."""
    from hylo.ops.indexer import kernels

    slots = 64 * KPOOL
    keys, gates = (torch.zeros(slots, INDEX_DIM, dtype=torch.bfloat16) for _ in range(2))
    ape = torch.zeros(KPOOL, INDEX_DIM)
    pooled = torch.zeros(slots // KPOOL, INDEX_DIM, dtype=torch.float8_e4m3fn)
    _as_dependents(kernels)
    pools = torch.tensor([3])
    return lambda: kernels.compress_pools(keys, gates, ape, pools, pooled, torch.ones(slots // KPOOL))


def dflash_inputs(blocks: int, width: int = 8) -> Callable[[], object]:
    """A DFlash verify step's index arithmetic (observe's slots and the next blocks) at `blocks` blocks of
    `width` tokens, and its draft layers' residual add with the next norm (bf16, hidden 4096)."""
    from hylo.ops.dflash_inputs import CommittedTokens, kernels
    from hylo.ops.norm import kernels as norm_kernels

    tokens = blocks * width
    token_seq = torch.arange(blocks).repeat_interleave(width)
    pad_index = torch.arange(tokens).view(blocks, width)
    committed = CommittedTokens(token_seq, pad_index, torch.arange(tokens), torch.arange(tokens),
                                torch.full((blocks,), width, dtype=torch.int32))  # fmt: skip
    rows, anchors = torch.arange(blocks), torch.zeros(blocks, dtype=torch.int64)
    hidden = torch.zeros(blocks, width, HIDDEN, dtype=torch.bfloat16)
    _as_dependents(kernels, norm_kernels)
    return lambda: (
        kernels.committed_slots(committed),
        kernels.draft_blocks(committed, rows, rows, anchors, width, 154879),
        norm_kernels.add_rms_norm(hidden, hidden, torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6),
    )


def cases(kda_heads: int) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each case's launches (made when called): the slice's B = 1 and B = 8 decode batches, a TP4 and a TP8
    rank's KDA step at B = 1 (16 and 8 heads, whose kernel tiles differ from the slice's), and the KDA block
    verify of a speculative step with 8 tokens at B = 8 and 16 at B = 1 and 8 (`kda_verify_*`: launched in
    order, not as a programmatic dependent; at B = 1 with 8 tokens its launch keeps 8 bytes a thread on the
    stack at 255 registers and still measured fastest, RESULTS S50-2), and a DFlash verify step's index
    arithmetic at 8 blocks of 8."""
    return {
        "kda_step_b1": lambda: kda_step(1, kda_heads),
        "kda_step_b8": lambda: kda_step(8, kda_heads),
        "kda_step_tp4_rank_b1": lambda: kda_step(1, kda_heads // 4),
        "kda_step_tp8_rank_b1": lambda: kda_step(1, kda_heads // 8),
        "moe_prologue_t1": lambda: moe_prologue(1),
        "moe_prologue_t8": lambda: moe_prologue(8),
        "pool_compression": pool_compression,
        "moe_experts_t1": lambda: moe_experts(1),
        "moe_experts_t8": lambda: moe_experts(8),
        "moe_experts_tp8_rank_t1": lambda: moe_experts(1, ranks=8),
        "mhc_enter_t1": lambda: mhc_entry(1),
        "mhc_enter_t8": lambda: mhc_entry(8),
        "kda_verify_b8_t8": lambda: kda_verify(8, 8),
        "kda_verify_b1_t16": lambda: kda_verify(1, 16),
        "kda_verify_b8_t16": lambda: kda_verify(8, 16),
        "dflash_inputs_b8": lambda: dflash_inputs(8),
    }


def measure(kda_heads: int = HEADS) -> dict[str, list[dict[str, object]]]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("code_size compiles kernels: run it without TRITON_INTERPRET=1")
    return {name: compiled_launches(make()) for name, make in cases(kda_heads).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--kda-heads", type=int, default=HEADS, help="KDA heads (8: a TP8 rank's)")
    args = parser.parse_args()
    report = measure(args.kda_heads)
    print("| case | kernel | warps | registers | spilled bytes | SASS instructions |")
    print("|---|---|---|---|---|---|")
    for name, launches in report.items():
        for launch in launches:
            print(
                f"| {name} | {launch['kernel']} | {launch['num_warps']} | {launch['registers']} | "
                f"{launch['stack_bytes']} | {launch['instructions']} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
