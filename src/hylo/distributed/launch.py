"""Starting the ranks of one engine and noticing when one of them is lost.

`start(config)` returns this process's `Ranks` (`hylo.parallel.ranks`), on which the `Engine` is then
built: `Engine(config, ranks=start(config))`. One host: the process that calls it is rank 0; it starts
ranks 1 .. tp_size-1 as `python -m hylo.distributed.worker` processes and serves clients. (Not
`multiprocessing`: its spawn method re-imports the caller's main module, which breaks any script
without a `__main__` guard, and fork would copy a parent whose CUDA is already initialised.) Several
hosts (`nnodes`): each host runs the same command with its `node_rank`; host n's process is rank
`n · tp_size/nnodes` and spawns the host's other ranks; only host 0 serves. Under `torchrun` no process
is spawned: every process is one rank, from `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and
`MASTER_ADDR`/`MASTER_PORT`.

Devices: a rank's device is `cuda:{local rank}` on GPUs (device collectives over NCCL) or the CPU
(gloo). Host messages (`control`) always go over a gloo group.

Failure: every collective has the `dist_timeout`. A spawned rank that exits unexpectedly is noticed
by its parent within a second (`Ranks.failure`); the parent's engine then fails its requests, and if
the process has not ended `FAILURE_EXIT_S` later (a thread stuck in a collective), it exits with
status 1.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hylo.config import EngineConfig
from hylo.parallel.control import Publisher
from hylo.parallel.layout import Parallel
from hylo.parallel.ranks import LOAD_TIMEOUT_S, Ranks

logger = logging.getLogger("hylo")
FAILURE_EXIT_S = 20.0
_POLL_S = 0.5


def torchrun_rank() -> int | None:
    """This process's rank when `torchrun` started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def start(config: EngineConfig) -> Ranks:
    """This process's rank of an engine of `config.tp_size` ranks: one rank, a `torchrun` rank, or the
    first rank of this host, which spawns the host's other ranks first (they load in parallel)."""
    if config.tp_size == 1:
        return Ranks()
    if dist.is_initialized():
        raise ValueError(
            "tp_size > 1: this process already runs a tensor-parallel engine; close it first (Engine.close)"
        )
    rank = torchrun_rank()
    if rank is not None:
        if int(os.environ["WORLD_SIZE"]) != config.tp_size:
            raise ValueError(
                f"tp_size ({config.tp_size}) must equal torchrun's WORLD_SIZE ({os.environ['WORLD_SIZE']})"
            )
        ranks = join(config, rank, "env://", int(os.environ.get("LOCAL_RANK", rank)))
        atexit.register(ranks.close)
        return ranks
    per_node = config.tp_size // config.nnodes
    first = config.node_rank * per_node
    address = config.dist_init_addr or f"127.0.0.1:{_free_port()}"
    settings = json.dumps(dataclasses.asdict(config))
    workers = {}
    for local in range(1, per_node):
        command = [
            sys.executable,
            "-m",
            "hylo.distributed.worker",
            settings,
            str(first + local),
            address,
            str(local),
        ]
        workers[first + local] = subprocess.Popen(command)
    ranks = Ranks(workers=workers)
    threading.Thread(target=_monitor, args=(ranks,), name="hylo-ranks", daemon=True).start()
    try:
        joined = join(config, first, f"tcp://{address}", 0)
    except BaseException:
        ranks.discard()
        raise
    ranks.parallel, ranks.device, ranks.control, ranks.publisher = (
        joined.parallel, joined.device, joined.control, joined.publisher,
    )  # fmt: skip
    atexit.register(ranks.close)
    return ranks


def join(config: EngineConfig, rank: int, init_method: str, local_rank: int) -> Ranks:
    """Join the process groups as `rank` (every rank calls this once)."""
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"tp_size: local rank {local_rank} needs GPU {local_rank}, this host has "
                f"{torch.cuda.device_count()}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    # meeting waits as long as loading may (ranks start at different times); the groups the engine
    # uses then wait `dist_timeout` a collective
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=config.tp_size,
        timeout=timedelta(seconds=LOAD_TIMEOUT_S), device_id=device if cuda else None,
    )  # fmt: skip
    timeout = timedelta(seconds=config.dist_timeout)
    collectives = dist.new_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    parallel = Parallel(
        rank, config.tp_size, config.ep_size or config.tp_size, collectives,
        sequence_parallel_tokens=config.sequence_parallel_tokens,
    )  # fmt: skip
    publisher = Publisher(control, config.dist_timeout) if rank == 0 else None
    return Ranks(parallel, device, control, publisher)


def _monitor(ranks: Ranks) -> None:
    """Notice a spawned rank that exits while the engine runs; end this process if it cannot."""
    while not ranks._closed:
        for rank, proc in ranks.workers.items():
            if proc.poll() is not None and not ranks._closed:
                ranks.failure = f"rank {rank} exited with status {proc.returncode}"
                logger.error("%s: the engine cannot go on; failing every request", ranks.failure)
                for other in ranks.workers.values():
                    if other.poll() is None:
                        other.terminate()
                time.sleep(FAILURE_EXIT_S)
                logger.error("%s: exiting", ranks.failure)
                os._exit(1)
        time.sleep(_POLL_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
