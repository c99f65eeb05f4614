"""A CUDA engine runs torch's CPU ops on one thread unless OMP_NUM_THREADS says otherwise; a CPU engine
keeps its threads (`engine.builder.limit_host_threads`). No GPU is needed: only the device's type is read."""

from __future__ import annotations

import pytest
import torch

from hylo.engine.builder import limit_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_cuda_engine_runs_host_ops_on_one_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads(torch.device("cuda", 0))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_cpu_engine_or_omp_num_threads_keeps_them(threads, monkeypatch, device):
    if device == "cuda":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads(torch.device(device))
    assert torch.get_num_threads() == 2
