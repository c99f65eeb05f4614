"""The decode step's Triton kernels compiled for sm_90a (no GPU needed: `benchmarks/kernels/code_size.py`
with Triton's bundled ptxas), at GLM-5.3-Flash's shapes: what costs a decode step that a warm
microbenchmark does not show. A spilled register is local-memory traffic on every step; a kernel whose
code grows with the tokens it routes is fetched cold once per layer (the unrolled MoE prologue took 34 us
a call at 8 tokens in the H100 replay, 17 looped: RESULTS S33-2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    # its own process: a test process whose interpreter tests set TRITON_INTERPRET has interpreted kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    out = tmp_path_factory.mktemp("code") / "code.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kernels/code_size.py"), "--json", str(out)],
        env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_decode_kernels_do_not_spill(compiled):
    launches = [(case, launch) for case, found in compiled.items() for launch in found]
    assert {launch["kernel"] for _, launch in launches} >= {
        "_recurrent_kernel", "_gated_norm_kernel", "_prologue_kernel", "_compress_kernel", "_gate_up_kernel",
        "_down_combine_kernel", "_split_project_kernel", "_finish_collapse_kernel", "_block_verify_kernel",
    }  # fmt: skip
    spilled = [
        (case, launch["kernel"], launch["stack_bytes"]) for case, launch in launches if launch["stack_bytes"]
    ]
    assert not spilled


def test_decode_kernels_compile_as_dependent_launches(compiled):
    """Every decode kernel, compiled for Hopper as a programmatic dependent (`ops.dependent_launch`; the
    interpreter cannot run griddepcontrol), waits on the launch before it and releases the next one."""
    launches = [
        (case, launch)
        for case, found in compiled.items()
        if not case.startswith("kda_verify")  # the verify step's block verify launches in order
        for launch in found
    ]
    assert {launch["kernel"] for _, launch in launches} >= {
        "_split_project_kernel", "_gated_norm_kernel", "_committed_slots_kernel", "_draft_blocks_kernel",
        "_add_rms_norm_kernel",
    }  # fmt: skip
    assert [(case, launch["kernel"]) for case, launch in launches if not launch["waits"]] == []
    assert [(case, launch["kernel"]) for case, launch in launches if not launch["releases"]] == []


def test_moe_prologue_code_does_not_grow_with_its_tokens(compiled):
    """At 8 tokens the prologue holds wider tiles and routes by arg-max passes instead of one top-k,
    but no copy of its code per token or per choice (unrolled so, it was 4.5x its one-token length)."""
    (one,), (eight,) = compiled["moe_prologue_t1"], compiled["moe_prologue_t8"]
    assert eight["instructions"] < 3 * one["instructions"]
