"""The decode profile's CUDA GEMV floors, on the CPU: `rank_e2e.gemv_census` counts each launch by shape and
the weight bytes by template variant, and `decode_profile.with_gemv_floors` puts each variant's bytes, floor
and share beside its kernel row (the profiler names a ctypes launch by its template alone); and its exposed
table, what each kernel adds to a replay's span on the profiler's timeline, and the table it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

import pytest
from decode_profile import exposed_table, markdown_table, with_gemv_floors
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
        {"kernel": "void (anonymous namespace)::fp8_gemv_kernel<1, 2, 3, 4, true>((anonymous namespace)::"
                   "Problem)", "us": 250.0, "launches": 11.0},
    ]  # fmt: skip
    out = with_gemv_floors(rows, {(1, 1, 2): 975_000_000, (1, 2, 4): 480_000_000}, 3.0e12)
    assert out[3]["floor_us"] == 160.0 and out[3]["of_floor"] == 0.64  # the whole-block flag in the name
    assert (
        out[0]["floor_us"] == 325.0
        and out[0]["of_floor"] == round(325.0 / 504.1, 3)
        and out[0]["gb"] == 0.975
    )
    assert out[1] == rows[1] and out[2] == rows[2]  # no census entry for that variant; not a GEMV


def test_exposed_time_leaves_out_a_dependents_wait_and_adds_up_to_the_span():
    # two replays of: a (0-10), a dependent b started at 4 that ends at 25 (its own 21 us hold a 6-us wait),
    # c inside b's time (nothing exposed), then d after a 3-us gap; the second replay 100 us later, given
    # out of order (the profiler's event list is not sorted by start)
    one = [("a", 0.0, 10.0), ("b", 4.0, 25.0), ("c", 12.0, 20.0), ("d", 28.0, 30.0)]
    spans = [(n, s + 100, e + 100) for n, s, e in reversed(one)] + one
    table = exposed_table(spans, reps=2)
    assert table["span_us"] == 30.0 and table["gaps_us"] == 3.0
    assert table["kernels"] == [
        {"kernel": "b", "exposed_us": 15.0, "launches": 1.0},
        {"kernel": "a", "exposed_us": 10.0, "launches": 1.0},
        {"kernel": "d", "exposed_us": 2.0, "launches": 1.0},
        {"kernel": "c", "exposed_us": 0.0, "launches": 1.0},
    ]
    assert sum(r["exposed_us"] for r in table["kernels"]) + table["gaps_us"] == table["span_us"]


def test_exposed_table_refuses_spans_that_are_not_whole_replays():
    with pytest.raises(ValueError, match="3 kernel spans do not split into 2 replays"):
        exposed_table([("a", 0.0, 1.0), ("b", 1.0, 2.0), ("a", 5.0, 6.0)], reps=2)


def test_the_printed_table_puts_each_kernel_beside_its_exposed_time_and_floor():
    step = {
        "replay_ms": 2.0, "floor_ms": 1.5,
        "kernels": [
            {"kernel": "fp8_gemv_kernel<1, 1, 3, 2, true>", "us": 40.0, "launches": 1.0, "gb": 0.1,
             "floor_us": 30.0, "of_floor": 0.75},
            {"kernel": "_split_project_kernel", "us": 9.0, "launches": 2.0},
        ],
        "exposed": {"span_us": 2000.0, "gaps_us": 3.5, "kernels": [
            {"kernel": "_split_project_kernel", "exposed_us": 4.0, "launches": 2.0},
            {"kernel": "fp8_gemv_kernel<1, 1, 3, 2, true>", "exposed_us": 38.0, "launches": 1.0},
        ]},
        "bytes_by_kind": {"lm_head": {"gb": 1.2, "floor_us": 400.0},
                          "projections fp8": {"gb": 1.5, "floor_us": 500.0}},
    }  # fmt: skip
    lines = markdown_table(step).splitlines()
    assert lines[0] == "replay 2.0 ms, floor 1.5 ms (75.0%); span 2000.0 us"
    assert lines[4] == "| fp8_gemv_kernel<1, 1, 3, 2, true> | 40.0 | 38.0 | 1.0 | 30.0 | 0.75 |"
    assert lines[5] == "| _split_project_kernel | 9.0 | 4.0 | 2.0 |  |  |"
    assert lines[6] == "| (gaps between kernels) | | 3.5 | | | |"
    assert lines[7:] == [
        "| floor of projections fp8 (1.5 GB) | | | | 500.0 | |",
        "| floor of lm_head (1.2 GB) | | | | 400.0 | |",
    ]
