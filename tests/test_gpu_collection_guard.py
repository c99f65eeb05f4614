"""The collection guard of conftest.py: on a GPU machine, CUDA test files collected in a process whose
Triton runs interpreted (an interpreter test module was imported) stop the run with a usage error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import torch


def items(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(path=Path("tests") / name) for name in names]


def test_cuda_files_beside_the_interpreter_stop_the_run_on_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(pytest.UsageError, match=r"test_overlap_cuda\.py"):
        conftest.pytest_collection_modifyitems(None, items("test_mhc_kernels.py", "test_overlap_cuda.py"))
    conftest.pytest_collection_modifyitems(None, items("test_mhc_kernels.py"))  # no CUDA file: runs
    monkeypatch.delenv("TRITON_INTERPRET")
    conftest.pytest_collection_modifyitems(None, items("test_overlap_cuda.py"))  # compiled Triton: runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    conftest.pytest_collection_modifyitems(None, items("test_overlap_cuda.py"))  # CPU CI: the CUDA tests skip
