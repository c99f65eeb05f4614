"""One rank of a tensor/expert-parallel engine, alone on one device, to measure that rank's GPU work.

Only four or eight GPUs hold the full GLM-5.3-Flash; one rank's share of it (~82 GB at TP4, ~41 GB at
TP8) fits one. `rank_engine(config, rank)` builds rank `rank` of an engine of `config.tp_size` ranks
with `load_format="dummy"` weights: the tensors rank `rank` of a real engine holds (the same loader,
shards and seeded draws: its TP heads, its experts when split by expert, its vocabulary rows) and the
collectives at the same points, recorded by a `StandInCollectives` instead of run (an all-reduce keeps
the rank's partial sum, an all-gather repeats the rank's part). Its tokens are therefore not the real
engine's: it is for timing a rank's steps and counting its collectives (`benchmarks/device/rank_e2e.py`).
Safe to use when nothing reads its text; nothing in the CLI, the server or `LLM` builds one.
"""

from __future__ import annotations

import torch

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.parallel.layout import Parallel, StandInCollectives
from hylo.parallel.ranks import Ranks


def rank_engine(config: EngineConfig, rank: int) -> Engine:
    """Rank `rank` of `config.tp_size` (experts split by `config.ep_size`) on `config.device`, its
    collectives recorded by a stand-in (`engine.model.parallel.stand_in.calls`)."""
    if config.load_format != "dummy":
        raise ValueError(
            f"a rank engine builds random weights: load_format must be dummy, got {config.load_format!r}"
        )
    if config.tp_size < 2:
        raise ValueError(
            f"a rank engine stands for one of several ranks: tp_size must be at least 2, got {config.tp_size}"
        )
    if config.nnodes != 1:
        raise ValueError("a rank engine runs on one device: nnodes must be 1")
    device = None if config.device == "auto" else torch.device(config.device)
    parallel = Parallel(
        rank, config.tp_size, config.ep_size or config.tp_size, None, StandInCollectives(),
        sequence_parallel_tokens=config.sequence_parallel_tokens,
    )  # fmt: skip
    return Engine(config, ranks=Ranks(parallel, device))
