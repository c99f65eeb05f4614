"""The decode profile's CUDA GEMV floors, on the CPU: `rank_e2e.gemv_census` counts each launch by shape and
the weight bytes by template variant, and `decode_profile.with_gemv_floors` puts each variant's bytes, floor
and share beside its kernel row (the profiler names a ctypes launch by its template alone)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

from decode_profile import with_gemv_floors
from rank_e2e import gemv_census

from hylo.ops.gemm import gemv_cuda


def test_census_counts_launches_and_bytes_by_template_variant(monkeypatch):
    monkeypatch.setattr(gemv_cuda, "_launch", lambda library, x, *rest: x)
    weight = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 4)
    with gemv_census() as census:
        for m, split, slices in ((1, 1, 2), (1, 1, 2), (12, 1, 2), (1, 2, 4)):
            gemv_cuda._launch(None, torch.zeros(m, 512), weight, scale, split, slices, False)
    assert gemv_cuda._launch(None, "x", weight, scale, 1, 2, False) == "x"  # the stub is back, uncounted
    assert census.calls == {
        "1 x 256 x 512, split 1, 2 warps over K": 2,
        "12 x 256 x 512, split 1, 2 warps over K": 1,
        "1 x 256 x 512, split 2, 4 warps over K": 1,
    }
    one = 256 * 512 + 2 * 4 * 4  # e4m3 weight and fp32 block scales
    assert census.weight_bytes == {(1, 1, 2): 2 * one, (2, 1, 2): one, (1, 2, 4): one}


def test_gemv_rows_get_their_floor_and_others_stay():
    rows = [
        {"kernel": "void (anonymous namespace)::fp8_gemv_kernel<1, 1, 3, 2>((anonymous namespace)::Problem)",
         "us": 504.1, "launches": 11.0},
        {"kernel": "void (anonymous namespace)::fp8_gemv_kernel<1, 4, 3, 2>((anonymous namespace)::Problem)",
         "us": 18.9, "launches": 2.0},
        {"kernel": "_gate_up_kernel", "us": 319.5, "launches": 5.0},
    ]  # fmt: skip
    out = with_gemv_floors(rows, {(1, 1, 2): 975_000_000}, 3.0e12)
    assert (
        out[0]["floor_us"] == 325.0
        and out[0]["of_floor"] == round(325.0 / 504.1, 3)
        and out[0]["gb"] == 0.975
    )
    assert out[1] == rows[1] and out[2] == rows[2]  # no census entry for that variant; not a GEMV
