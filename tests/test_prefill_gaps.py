"""`benchmarks/device/prefill_gaps.py`'s timeline arithmetic, on the CPU: kernels that overlap count once,
the GPU's idle gaps are measured between the last end so far and the next start."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

from prefill_gaps import Gap, busy_and_gaps


def test_overlapping_kernels_count_once_and_gaps_follow_the_last_end():
    kernels = [  # (start, end, name) µs, out of order
        (130.0, 140.0, "e"),
        (10.0, 30.0, "a"),
        (25.0, 40.0, "b"),  # a dependent that started before a ended
        (28.0, 35.0, "c"),  # inside b: no gap after it, b ends last
        (100.0, 110.0, "d"),
    ]
    busy, gaps = busy_and_gaps(kernels)
    assert busy == (40 - 10) + (110 - 100) + (140 - 130)
    assert gaps == [Gap(60.0, 30.0, "b", "d"), Gap(20.0, 100.0, "d", "e")]


def test_back_to_back_kernels_leave_no_gap():
    busy, gaps = busy_and_gaps([(0.0, 5.0, "a"), (5.0, 9.0, "b")])
    assert busy == 9.0 and gaps == []
