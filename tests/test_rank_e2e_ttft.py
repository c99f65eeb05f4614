"""`benchmarks/device/rank_e2e.py`'s TTFT, on the CPU with a stand-in engine: the median's samples are the
prompts after the one that compiles, each prompt its own tokens of the asked length."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

from rank_e2e import ttft_ms


class CompilingEngine:
    """Takes 30 ms over its first prompt (a new shape's kernels compile), 1 ms over later ones."""

    def __init__(self):
        self.prompts, self.waiting = [], False

    def add_request(self, rid, prompt, params):
        assert params.max_tokens == 1
        self.prompts.append(prompt)
        self.waiting = True

    def has_unfinished(self):
        return self.waiting

    def step(self):
        time.sleep(0.03 if len(self.prompts) == 1 else 0.001)
        self.waiting = False


def test_ttft_times_the_prompts_after_the_compiling_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    engine = CompilingEngine()
    times = ttft_ms(engine, 64, 3)
    assert len(times) == 3 and len(engine.prompts) == 4
    assert all(0.9 <= t < 25 for t in times)  # the 30 ms first prompt is not among them
    assert all(len(p) == 64 for p in engine.prompts)
    assert len({tuple(p) for p in engine.prompts}) == 4  # no prefix reuse between them
