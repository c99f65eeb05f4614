"""Measured launch configurations of the small-M GEMM, one JSON table per GPU model.

A table maps `(M bucket, N, K, weight format)` to the configuration that beat the alternative for
that shape on that GPU: cuBLAS for bf16 weights, `heuristic_config` for e4m3 ones (`_fp8` keys);
`benchmarks/kernels/gemm_tune.py` writes it after checking the kernel against the reference. Shapes
without an entry (or GPUs without a table) take that alternative.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TABLES = Path(__file__).parent / "tables"
M_BUCKETS = (16, 32, 64)


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration; `split_k` programs share each output tile's K range. `quant_x`
    (e4m3 weights only): the activations are quantised to e4m3 in the kernel and the product runs on
    the FP8 tensor cores (w8a8, cuBLAS's block-scaled matmul's error) instead of widening the weight.
    `swap_ab`: the kernel computes the transposed tile (weight rows as the MMA's M side; see `kernels`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    quant_x: bool = False
    swap_ab: bool = False


def m_bucket(m: int) -> int | None:
    """The smallest bucket holding `m` rows, None above the small-M range."""
    return next((b for b in M_BUCKETS if m <= b), None)


SPLIT_MIN_K = 384  # K per split program: below it the partials' extra write and sum outweigh the split
MAX_SPLIT_K = 8
ROWS_PER_SM = 128  # x rows a GPU's programs may hold per SM (row tile × programs) before splitting stops


def heuristic_config(rows: int, n: int, k: int, sm_count: int) -> GemmConfig:
    """The configuration of an `x [rows, K] @ weight [N, K]ᵀ` product no table entry names. Rows of a
    few are bound by reading the weight once, so the work is spread until every SM streams: the row
    tile is the M bucket (64 above the small-M range), output tiles 64 wide (32 under 1024 columns),
    and where those tiles are fewer than the SMs, K is split in the largest power of two up to
    `MAX_SPLIT_K` that keeps programs × row tile within `ROWS_PER_SM` per SM and at least
    `SPLIT_MIN_K` of K a program (64-row tiles thus split half as far as 32-row ones: their programs
    already carry twice the MMA work). 64-row tiles over a grid that fills the SMs unsplit take the
    transposed orientation (`swap_ab`). `block_k` 128 lies inside one FP8 scale block. Measured with
    the tables hidden on the H100 (RESULTS S30-1): within 1.18x of every tuned FP8 entry."""
    block_m = m_bucket(rows) or M_BUCKETS[-1]
    block_n = 32 if n < 1024 else 64
    tiles = -(-n // block_n) * -(-rows // block_m)
    split = 1
    while (
        tiles < sm_count
        and split < MAX_SPLIT_K
        and tiles * split * 2 * block_m <= ROWS_PER_SM * sm_count
        and k // (split * 2) >= SPLIT_MIN_K
    ):
        split *= 2
    swap_ab = block_m == 64 and block_n == 64 and tiles >= sm_count
    return GemmConfig(block_m, block_n, 128, split, 4, 3, swap_ab=swap_ab)


NARROW_MAX_N = 256  # the dense parts of FP8 FusedLinears: KDA's b (a row a head), the indexer's head weights


def entry_key(bucket: int, n: int, k: int, fp8: bool = False) -> str:
    return f"m{bucket}_n{n}_k{k}" + ("_fp8" if fp8 else "")


def table_path(gpu_name: str) -> Path:
    return TABLES / (re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json")


@cache
def load_table(gpu_name: str) -> dict[str, GemmConfig]:
    path = table_path(gpu_name)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("gpu") != gpu_name:
        raise ValueError(f"{path}: table is for {data.get('gpu')!r}, not {gpu_name!r}")
    return {key: GemmConfig(**entry["config"]) for key, entry in data["entries"].items()}


def lookup(gpu_name: str, m: int, n: int, k: int, fp8: bool = False) -> GemmConfig | None:
    bucket = m_bucket(m)
    return None if bucket is None else load_table(gpu_name).get(entry_key(bucket, n, k, fp8))
