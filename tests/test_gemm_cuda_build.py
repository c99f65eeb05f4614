"""The CUDA GEMV's build and dispatch logic, on the CPU: the cache key, the cached and locked build, the
fallback (with its reason) when nvcc is missing or fails, the real `fp8_gemv.cu` compiled for sm_90a with
this machine's nvcc and its C entry points called through ctypes (no GPU needed for either), the grid's
K split, the error bound the GPU tests use, and the start-up line saying what small-M FP8 GEMMs run on."""

from __future__ import annotations

import ctypes
import fnmatch
import logging
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch
import triton

from hylo.ops import gemm
from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.gemm import cuda_build, gemv_cuda

# the GLM-5.3-Flash FP8 projections (N, K) and TP-rank shards of them (N or K over 4 and 8)
MODEL_SHAPES = [
    (24576, 4096), (12288, 4096), (4096, 8192), (4096, 16384), (4096, 12288), (2176, 4096),
    (2048, 4096), (4096, 2048), (16384, 1536), (4096, 1536), (8192, 128), (256, 4096),
]  # fmt: skip
RANK_SHAPES = [
    (24576 // 8, 4096),
    (12288 // 8, 4096),
    (4096, 16384 // 8),
    (4096, 8192 // 4),
    (2176 // 8, 4096),
]


def fake_nvcc(directory, body: str) -> str:
    """An executable `nvcc` in `directory` running the shell `body` (`$@` are nvcc's arguments)."""
    path = directory / "nvcc"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache, and no nvcc but the test's own (PATH holds only `tmp_path/bin`)."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    (tmp_path / "bin").mkdir()
    gemv_cuda.load_library.cache_clear()
    yield tmp_path
    gemv_cuda.load_library.cache_clear()


def test_cache_key_follows_source_toolkit_and_arch():
    key = cuda_build.cache_key(b"source", "nvcc 13.0", "sm_90a")
    assert key == cuda_build.cache_key(b"source", "nvcc 13.0", "sm_90a")
    others = {
        cuda_build.cache_key(b"source2", "nvcc 13.0", "sm_90a"),
        cuda_build.cache_key(b"source", "nvcc 12.8", "sm_90a"),
        cuda_build.cache_key(b"source", "nvcc 13.0", "sm_100a"),
    }
    assert key not in others and len(others) == 3


def test_an_included_header_is_part_of_the_key(tmp_path):
    """A kernel's library depends on the headers it includes by a quoted path: changing one changes
    the bytes the key hashes; a header it names that is not there is a build error naming it."""
    (tmp_path / "kernels").mkdir()
    source = tmp_path / "kernels" / "k.cu"
    source.write_text('#include <stdint.h>\n#include "../shared/h.cuh"\nint f() { return g(); }\n')
    (tmp_path / "shared").mkdir()
    header = tmp_path / "shared" / "h.cuh"
    header.write_text('#pragma once\n#include "h.cuh"\nint g() { return 1; }\n')  # includes itself: once
    before = cuda_build.source_bytes(source)
    header.write_text("#pragma once\nint g() { return 2; }\n")
    assert cuda_build.source_bytes(source) != before and b"return 2" in cuda_build.source_bytes(source)
    header.unlink()
    with pytest.raises(cuda_build.BuildError, match=r"includes \.\./shared/h\.cuh"):
        cuda_build.source_bytes(source)


def test_every_kernel_source_ships_in_the_package():
    """An installed (non-editable) hylo builds its CUDA kernels from the package's own files: every `.cu`
    and `.cuh` under src/hylo matches a package-data pattern of pyproject.toml (the sparse MLA prefill
    and the shared headers once did not, so a wheel would have fallen back to Triton)."""
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["hylo"]
    package = root / "src" / "hylo"
    sources = [p.relative_to(package).as_posix() for p in package.rglob("*.cu*")]
    assert len(sources) >= 3
    for source in sources:
        assert any(fnmatch.fnmatch(source, pattern) for pattern in patterns), source


def test_cache_dir_follows_hylo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    assert cuda_build.cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("HYLO_CACHE")
    assert cuda_build.cache_dir().parts[-3:] == (".cache", "hylo", "kernels")


def test_missing_nvcc_falls_back_with_its_reason(cache, caplog):
    with pytest.raises(cuda_build.BuildError, match="no nvcc"):
        cuda_build.build(gemv_cuda.SOURCE, "sm_90a", "a test kernel")
    with caplog.at_level(logging.WARNING, logger="hylo"):
        first, second = gemv_cuda.load_library("sm_90a"), gemv_cuda.load_library("sm_90a")
    assert isinstance(first, str) and "no nvcc" in first and second == first
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "run the Triton kernel" in warnings[0]  # once per process


def test_cuda_home_nvcc_is_found(cache, monkeypatch):
    home = cache / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = fake_nvcc(home / "bin", "exit 0")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert cuda_build.find_nvcc() == nvcc


def test_failed_compile_reports_nvcc_stderr(cache):
    fake_nvcc(
        cache / "bin",
        'case "$1" in --version) echo "fake nvcc 1.0";; *) echo "bad kernel" >&2; exit 2;; esac',
    )
    with pytest.raises(cuda_build.BuildError, match="exited with 2: bad kernel"):
        cuda_build.build(gemv_cuda.SOURCE, "sm_90a", "a test kernel")
    assert not list((cache / "cache" / "kernels").glob("*.so*"))  # no half-written library left behind


def test_build_compiles_once_then_reads_the_cache(cache, caplog):
    """The fake nvcc writes its output file (after `-o`) and counts its compilations."""
    calls = cache / "calls"
    body = (
        'if [ "$1" = --version ]; then echo "fake nvcc 1.0"; exit 0; fi\n'
        f'echo x >> {calls}\n'
        'while [ "$1" != -o ]; do shift; done; echo library > "$2"'
    )  # fmt: skip
    fake_nvcc(cache / "bin", body)
    with caplog.at_level(logging.INFO, logger="hylo"):
        first = cuda_build.build(gemv_cuda.SOURCE, "sm_90a", "the FP8 GEMV kernel")
        second = cuda_build.build(gemv_cuda.SOURCE, "sm_90a", "the FP8 GEMV kernel")
    assert (
        first == second and first.read_text() == "library\n" and first.parent == cache / "cache" / "kernels"
    )
    assert calls.read_text().count("x") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("building the FP8 GEMV kernel (sm_90a)") for m in messages)
    assert any(m.startswith("built the FP8 GEMV kernel (sm_90a) in ") for m in messages)
    other_arch = cuda_build.build(gemv_cuda.SOURCE, "sm_100a", "the FP8 GEMV kernel")
    assert other_arch != first and calls.read_text().count("x") == 2


class _Inner(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int), ("stride", ctypes.c_longlong)]


class _Call(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("inner", _Inner), ("scale", ctypes.c_float)]


class _Library:
    """A library whose `entry_call_layout` reports `fields` ({offset, size} pairs, as `call_layout.cuh`)."""

    def __init__(self, fields):
        self.fields, self.entry = fields, type("Entry", (), {})()

    def entry_call_layout(self, out, capacity):
        for i, (offset, size) in enumerate(self.fields[:capacity]):
            out[2 * i], out[2 * i + 1] = offset, size
        return len(self.fields)


def test_bind_call_refuses_a_library_whose_call_is_laid_out_otherwise():
    """A call structure's leaves in place (the nested one at its aligned offset); a library reporting the
    same leaves is bound to take a pointer to it, one with two fields swapped (same size), a field
    missing or one more is refused with both layouts in the message."""
    layout = [(0, 8), (8, 4), (16, 8), (24, 4)]
    assert cuda_build.leaf_layout(_Call) == layout
    library = _Library(layout)
    cuda_build.bind_call(library, "entry", _Call)
    assert library.entry.argtypes[0]._type_ is _Call and library.entry.restype is ctypes.c_int
    for fields in ([(0, 8), (8, 8), (16, 4), (24, 4)], layout[:3], [*layout, (28, 4)]):
        with pytest.raises(OSError, match=r"entry takes a _Call of \d fields at \(offset, size\)"):
            cuda_build.bind_call(_Library(fields), "entry", _Call)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_kernels_sharing_the_hopper_header_compile_for_hopper(tmp_path, monkeypatch, caplog):
    """The grouped MoE GEMMs and the sparse MLA prefill through the real build (about 10 s each), their
    C entry points there taking the call structures laid out as their ctypes mirrors (the loaders compare
    every field's place), and no performance loss ptxas reports (it serialised every wgmma of the sparse
    kernel while a wgmma stayed in flight across a loop exit it could not prove uniform)."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    from hylo.ops.moe import grouped_cuda
    from hylo.ops.sparse_mla import cuda_prefill

    with caplog.at_level(logging.WARNING, logger=cuda_build.logger.name):
        grouped = grouped_cuda.load_library().hylo_grouped_gemm
        sparse = cuda_prefill.load_library().hylo_sparse_mla_prefill
    assert grouped.argtypes[0]._type_ is grouped_cuda.GroupedCall
    assert sparse.argtypes[0]._type_ is cuda_prefill.SparseMlaCall
    assert not [r.getMessage() for r in caplog.records if "Performance Loss" in r.getMessage()]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize(
    "defines",
    [
        (),  # the shipped build: persistent, 256-column down tiles
        ("HYLO_GROUPED_PERSISTENT=0", "HYLO_GROUPED_WIDE_DOWN=0"),  # one CTA a tile, as S42 ran it
    ],
)
def test_the_grouped_gemms_schedules_compile_and_check_their_columns(tmp_path, monkeypatch, caplog, defines):
    """The grouped GEMMs' shipped and benchmark schedules build for Hopper with no wgmma serialised, and
    each library reads the columns where the `GroupedCall` puts them: a multiple of a CTA's (gate|up 128,
    down 256 or narrow 128), or 1003; then the rows' address (8: off the 16-byte grid a tensor map needs,
    1002, or 1001 with no driver at all)."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    from hylo.ops.moe import grouped_cuda

    with caplog.at_level(logging.WARNING, logger=cuda_build.logger.name):
        library = grouped_cuda.load_library(defines=defines)
    assert not [r.getMessage() for r in caplog.records if "Performance Loss" in r.getMessage()]
    down = 128 if "HYLO_GROUPED_WIDE_DOWN=0" in defines else 256
    rows = grouped_cuda.ScaledRows(data=8, stride=4096, count=64)
    for gate_up, columns in ((True, 128), (False, down)):
        for n, codes in ((columns, {1001, 1002}), (columns // 2, {1003}), (columns + 72, {1003})):
            call = grouped_cuda.GroupedCall(gate_up=int(gate_up), n=n, k=4096, a=rows)
            assert library.hylo_grouped_gemm(ctypes.byref(call), None) in codes, (gate_up, n)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_kernel_compiles_for_hopper_and_its_entry_points_load(tmp_path, monkeypatch):
    """The real source through the real build (about 30 s). The library loads without a GPU (its CUDA
    runtime is linked in and reaches the driver only at a launch), reports its CTA rows, takes the
    `GemvCall` laid out as gemv_cuda's mirror (the loader compares every field's place), and refuses
    arguments it does not support before touching a GPU (cudaErrorInvalidValue = 1)."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    library = gemv_cuda.load_library("sm_90a")
    assert not isinstance(library, str), library
    assert library.hylo_fp8_gemv_cta_rows() == gemv_cuda.CTA_ROWS
    # rows of x past 16, none, K off the 16-byte grid, x's rows off the 8-element grid, a split or warps
    # over K not compiled, 4 warps over K for more than 8 rows
    for m, k, stride, split, slices in ((17, 4096, 4096, 1, 2), (0, 4096, 4096, 1, 2), (4, 4100, 4104, 1, 2),
                                        (4, 4096, 4100, 1, 2), (4, 4096, 4096, 3, 2), (4, 4096, 4096, 1, 3),
                                        (9, 4096, 4096, 1, 4)):  # fmt: skip
        call = gemv_cuda.GemvCall(
            x=gemv_cuda.GemvRows(None, stride, m),
            w=gemv_cuda.BlockScaledWeight(None, None, 1, 128, k),
            plan=gemv_cuda.GemvPlan(split, slices, 0),
        )
        assert library.hylo_fp8_gemv(ctypes.byref(call), None) == 1


# Triton's wheel carries cuobjdump (what `benchmarks/kernels/code_size.py` reads SASS with)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
GEMV_KERNEL = re.compile(r"Function : \S*fp8_gemv_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb([01])E")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("defines", [(), ("HYLO_GEMV_DEPTH_8=2", "HYLO_GEMV_MIN_CTAS_8=3")])
def test_every_gemv_kernel_streams_its_first_weights_before_its_wait(tmp_path, monkeypatch, defines):
    """In the SASS of the real build (the shipped defaults, and the candidate of RESULTS S53-2), every kernel
    issues its ring's first DEPTH blocks of weights (4 streaming loads a block) before `griddepcontrol.wait`
    (ACQBULK), so that as a programmatic dependent it streams them while the kernel before it finishes. ptxas
    had hoisted the wait to the first instruction of the whole-block kernels once their loads lost their
    bounds (0042f30; the decode replay without dependent launches could not see it)."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    library = cuda_build.build(gemv_cuda.SOURCE, "sm_90a", gemv_cuda.KERNEL, defines)
    dump = subprocess.run([CUOBJDUMP, "-sass", str(library)], capture_output=True, text=True, check=True)
    sass = dump.stdout
    kernels = re.split(r"(?=\s+Function : )", sass)
    seen = []
    for text in kernels:
        name = GEMV_KERNEL.search(text)
        if name is None:
            continue
        assert "ACQBULK" in text, name.group(0)
        before_wait = text[: text.index("ACQBULK")]
        seen.append((name.groups(), before_wait.count("LDG.E.NA")))
    # 2 row tiles x 4 splits x warps over K (2, and 4 up to 8 rows) x whole blocks or not
    assert len(seen) == 24
    assert all(loads == 4 * int(depth) for (_, _, depth, _, _), loads in seen), seen


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_l2_prefetch_variant_asks_for_its_weights_before_its_wait(tmp_path, monkeypatch):
    """With `HYLO_GEMV_L2_AHEAD_KIB` set (a benchmark variant; off by default), every kernel issues its bulk
    L2 prefetch (UBLKPF.L2) after its ring's first loads and before `griddepcontrol.wait`, so that it
    streams while the kernel before it runs; the default build issues none."""
    monkeypatch.setenv("HYLO_CACHE", str(tmp_path))
    for defines, wanted in (((), 0), (("HYLO_GEMV_L2_AHEAD_KIB=8192",), 1)):
        library = cuda_build.build(gemv_cuda.SOURCE, "sm_90a", gemv_cuda.KERNEL, defines)
        dump = subprocess.run([CUOBJDUMP, "-sass", str(library)], capture_output=True, text=True, check=True)
        kernels = [text for text in re.split(r"(?=\s+Function : )", dump.stdout) if GEMV_KERNEL.search(text)]
        assert len(kernels) == 24
        for text in kernels:
            wait, name = text.index("ACQBULK"), GEMV_KERNEL.search(text).group(0)
            assert text.count("UBLKPF.L2") == text[:wait].count("UBLKPF.L2") == wanted, name
            if wanted:
                assert text.rindex("LDG.E.NA", 0, wait) < text.index("UBLKPF.L2"), name


@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES + RANK_SHAPES)
def test_split_fills_the_gpu_without_idle_k_slices(n, k):
    """Clusters split K until about one CTA runs on every SM (132 SMs; the H100 measured two a SM
    slower, RESULTS S30-5), unless the 2 warps per CTA would outnumber the 128-k blocks; the split is
    one the library compiled."""
    split = gemv_cuda.split_for(n, k, 132)
    ctas = -(-n // gemv_cuda.CTA_ROWS) * split
    kblocks = -(-k // FP8_BLOCK)
    assert split in gemv_cuda.SPLITS and (split == 1 or 2 * split <= kblocks)
    assert ctas >= 0.9 * 132 or split == max(s for s in gemv_cuda.SPLITS if s == 1 or 2 * s <= kblocks)
    if split > 1:  # the smallest such split: half of it would leave SMs idle
        assert -(-n // gemv_cuda.CTA_ROWS) * split // 2 < 0.9 * 132


def test_the_n4096_projections_split_k_in_two():
    """The split S30-5 measured fastest on the H100 for GLM-5.3-Flash's N = 4096 projections (64 row
    groups: split 2 gives 128 CTAs, 16-30% faster than the 256 of split 4) and the ones around them."""
    assert [gemv_cuda.split_for(4096, k, 132) for k in (16384, 12288, 8192, 2048, 1536)] == [2] * 5
    assert gemv_cuda.split_for(2176, 4096, 132) == 4 and gemv_cuda.split_for(24576, 4096, 132) == 1


def test_wide_ctas_only_where_one_wave_of_warps_streams_long_k_runs():
    """`slices_for` (RESULTS S32-4, H100, one row of x): 4 warps over K for the single-wave N = 4096
    projections with K >= 8192 (measured 5-11% faster), 2 for the multi-wave and short-K ones (measured
    8-27% slower with 4) and for more than 8 rows of x (not compiled)."""

    def slices(n, k, m=1):
        return gemv_cuda.slices_for(m, n, k, gemv_cuda.split_for(n, k, 132), 132)

    assert [slices(4096, k) for k in (16384, 12288, 8192)] == [4, 4, 4]
    assert [slices(4096, k) for k in (4096, 2048)] == [2, 2]
    assert slices(24832, 4096) == slices(20480, 1536) == slices(2176, 4096) == 2
    assert slices(4096, 16384, m=8) == 4 and slices(4096, 16384, m=9) == 2


def test_error_bound_passes_the_rounded_product_and_fails_a_missing_scale():
    """`worst_error` (what the GPU tests and the self-check hold the kernel to): the float64 product
    rounded to bf16 is within it; the same product with one 128-k block's scale left out is not."""
    gen = torch.Generator().manual_seed(0)
    weight, scale = gemv_cuda.random_e4m3(200, 1040, gen)
    codes = weight.view(torch.uint8)
    subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
    assert not torch.isnan(weight.float()).any() and subnormal.any()
    x = torch.randn(5, 1040, generator=gen).to(torch.bfloat16)
    exact = gemv_cuda.exact_weight(weight, scale)
    assert exact.dtype == torch.float64
    good = (x.double() @ exact.t()).to(torch.bfloat16)
    assert gemv_cuda.worst_error(good, x, weight, scale) <= 1.0
    unscaled = scale.clone()
    unscaled[1, 3] = 1.0  # one block read without its scale
    bad = (x.double() @ gemv_cuda.exact_weight(weight, unscaled).t()).to(torch.bfloat16)
    assert gemv_cuda.worst_error(bad, x, weight, scale) > 1.0


def test_refusals_name_their_reason(monkeypatch):
    x = torch.randn(4, 256).to(torch.bfloat16)
    weight = torch.zeros(128, 256).to(torch.float8_e4m3fn)
    scale = torch.ones(1, 2)
    assert gemv_cuda.refusal(x, weight, scale) == "x is not on a CUDA device"
    assert not gemv_cuda.takes(x, weight, scale)
    monkeypatch.setenv(gemv_cuda.SWITCH, "0")
    assert gemv_cuda.device_refusal(torch.device("cuda", 0)) == "HYLO_FP8_GEMV=0"
    assert cuda_build.hopper_arch((9, 0)) == "sm_90a" and cuda_build.hopper_arch((8, 0)) is None


@pytest.mark.parametrize(("gpu", "gemv_off", "expected"), [
    ("NVIDIA H200", None, "tuned table nvidia_h200.json; CUDA GEMV for up to 16 rows: on"),
    ("NVIDIA H100 80GB HBM3", None,
     "tuned table nvidia_h100_80gb_hbm3.json; CUDA GEMV for up to 16 rows: on"),
    ("NVIDIA B300", "no nvcc", "no tuned table (heuristic configurations); CUDA GEMV for up to 16 rows: off ("
     "no nvcc)"),
])  # fmt: skip
def test_first_small_m_fp8_dispatch_says_what_it_runs_on(monkeypatch, caplog, gpu, gemv_off, expected):
    gemm._announce_small_m_fp8.cache_clear()  # a fresh process
    monkeypatch.setattr(gemm, "_gpu_name", lambda index: gpu)
    monkeypatch.setattr(gemv_cuda, "device_refusal", lambda device: gemv_off)
    with caplog.at_level(logging.INFO, logger="hylo"):
        gemm._announce_small_m_fp8(torch.device("cuda", 0))
        gemm._announce_small_m_fp8(torch.device("cuda", 0))
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("FP8 GEMMs of up to 64 rows")
    ]
    assert lines == [f"FP8 GEMMs of up to 64 rows on {gpu}: {expected}"]
