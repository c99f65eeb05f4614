"""Programmatic dependent launch (`hylo.ops.dependent_launch`): the contract every kernel that takes it
keeps, checked on the source (the launches themselves run on a Hopper GPU: test_fp8_gemv_cuda and the
graph-replay parity tests).

A Triton kernel launched as a dependent may start before the kernel ahead of it has finished; it is
correct only if nothing precedes its wait. So every `@triton.jit` kernel with a `PDL` parameter must
start with `enter(PDL)`, and every launch that passes `launch_pdl` must pass the same value as `PDL`
(a kernel launched as a dependent with PDL False would never wait)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from hylo.ops.dependent_launch import dependent_launches

OPS = Path(__file__).resolve().parents[1] / "src" / "hylo" / "ops"


def is_dependent_kernel(node: ast.AST) -> bool:
    """A `@triton.jit` function with a `PDL` parameter (`enter` itself aside)."""
    return (
        isinstance(node, ast.FunctionDef)
        and node.name != "enter"
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
        and any(a.arg == "PDL" for a in node.args.args)
    )


def jit_kernels_and_launches() -> tuple[list[tuple[str, ast.FunctionDef]], list[tuple[str, ast.Call]]]:
    kernels, launches = [], []
    for path in sorted(OPS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(OPS))
        for node in ast.walk(tree):
            if is_dependent_kernel(node):
                kernels.append((where, node))
            if isinstance(node, ast.Call) and any(k.arg == "launch_pdl" for k in node.keywords):
                launches.append((where, node))
    return kernels, launches


def test_every_dependent_kernel_waits_first():
    kernels, _ = jit_kernels_and_launches()
    assert len(kernels) >= 15  # the decode step's kernels: MoE, KDA, DSA, mHC, norms, GEMM, metadata
    for where, kernel in kernels:
        body = kernel.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        assert first == "enter(PDL)", f"{where}:{kernel.name} starts with {first!r}, not enter(PDL)"


def test_every_dependent_launch_passes_the_same_flag_to_the_kernel():
    _, launches = jit_kernels_and_launches()
    assert len(launches) >= 15
    for where, call in launches:
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
        if "launch_pdl" not in keywords:  # passed inside a **dict: the dict carries both
            continue
        assert keywords.get("PDL") == keywords["launch_pdl"], (
            f"{where}:{call.lineno}: launch_pdl={keywords['launch_pdl']} but PDL={keywords.get('PDL')}"
        )


def test_launches_off_hopper_are_plain():
    assert not dependent_launches(torch.device("cpu"))
