"""This process's rank of one engine, as the engine holds it: its share of the model (`Parallel`), its
device, the host group the ranks exchange start-up figures and step messages over (`control`), rank
0's `Publisher`, and the rank processes this one started. `hylo.distributed.launch` starts or joins
the ranks and returns this process's `Ranks`, which the engine is given; an engine of one rank holds
`Ranks()`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hylo.parallel.control import Publisher
from hylo.parallel.layout import SINGLE, Parallel

# how long ranks wait for each other to start and to finish loading: a large checkpoint takes minutes
# and ranks finish at different times (a rank that fails to load exits, and the others hear at once)
LOAD_TIMEOUT_S = 3600.0


@dataclass
class Ranks:
    """This process's rank of an engine. `publisher` is rank 0's (None elsewhere); `control` the gloo
    group of host messages (None for one rank); `workers` the ranks this process spawned."""

    parallel: Parallel = SINGLE
    device: torch.device | None = None
    control: dist.ProcessGroup | None = None
    publisher: Publisher | None = None
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    failure: str | None = None
    _closed: bool = False

    @property
    def leader(self) -> bool:
        return self.parallel.rank == 0

    def describe(self) -> dict:
        """For `/server_info`: the split, this rank, the processes this one started, any failure."""
        p = self.parallel
        return {
            "tp_size": p.size,
            "ep_size": p.ep_size,
            "rank": p.rank,
            "worker_pids": {rank: proc.pid for rank, proc in self.workers.items()},
            "failure": self.failure,
        }

    def loaded(self) -> None:
        """Wait until every rank has loaded its shard (up to `LOAD_TIMEOUT_S`, not the collectives'
        `dist_timeout`)."""
        if self.control is not None:
            dist.monitored_barrier(self.control, timeout=timedelta(seconds=LOAD_TIMEOUT_S))

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (the cache budget all ranks then share)."""
        if self.control is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank (start-up only: a pickled exchange)."""
        if self.control is None:
            return [value]
        values: list[Any] = [None] * self.parallel.size
        dist.all_gather_object(values, value, group=self.control)
        return values

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit and wait for the spawned ones (then end them)."""
        if self._closed:
            return
        if self.failure is not None:
            self.abandon()
        self._closed = True
        failed = False
        if self.publisher is not None:
            try:
                self.publisher.close()
            except RuntimeError:
                failed = True  # a rank is gone: the ones left end on their group's error
        for proc in self.workers.values():
            try:
                proc.wait(timeout=0 if failed else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def discard(self) -> None:
        """Kill the ranks this process started (an engine that failed to start; this process goes on
        to report why)."""
        self._closed = True
        for proc in self.workers.values():
            proc.kill()

    def abandon(self, status: int = 1) -> None:
        """After a failure: kill the ranks this process started and exit with `status` now, without
        finalisers (a thread may be waiting in a collective that will never complete, and tearing the
        groups down under it aborts the process). Nothing for an engine of one rank."""
        if self.control is None and not self.workers:
            return
        self._closed = True
        for proc in self.workers.values():
            proc.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
