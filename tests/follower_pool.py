"""Follower ranks that serve one tensor-parallel engine after another, for test modules that build
several small engines of a few ranks on the CPU: a spawned rank (`python -m hylo.distributed.worker`)
pays ~4 s of CPU importing torch and hylo, more than the small engine it then serves.

`FollowerPool.patch(monkeypatch)` makes `hylo.distributed.launch.start` hand each rank it would spawn
to a pooled process instead. That process does what the worker does with the same arguments (builds
the rank's engine, `Engine(config, ranks=join(...))`, and follows rank 0 until rank 0 shuts it down),
then closes that engine, reports it done, and waits for the next. Rank 0 holds a handle that answers
as the spawned worker's `Popen` does where `start`, its monitor and `Ranks` use it (`pid`, `poll`,
`wait`, `kill`, `terminate`, `returncode`): the engines, their start-up exchanges, steps and shutdown
run unchanged. A rank whose engine fails exits with status 1, as the worker does; a killed one is
replaced by a fresh process for the next engine.

Safe to use when a test checks what the engines compute, not how their ranks are started
(test_tensor_parallel_server starts and loses real worker processes).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import types

_DONE = b"d"  # one byte on the done pipe for each engine a pooled process has followed and closed


class _PooledRank:
    """One engine's rank in a pooled process, as `start` uses the `Popen` of a rank it spawned."""

    def __init__(self, process: subprocess.Popen, done_fd: int, args: list[str]):
        self.process, self.pid, self.args = process, process.pid, args
        self.returncode: int | None = None
        self._done_fd = done_fd
        self._lock = threading.Lock()  # rank 0's monitor thread polls while its engine thread waits

    def poll(self) -> int | None:
        return self._settle(0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._settle(0.1) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        self.process.kill()

    def terminate(self) -> None:
        self.process.terminate()

    def _settle(self, timeout: float) -> int | None:
        """The status once the engine is followed and closed (0) or the process has exited (its
        status); None while the rank still runs. Waits for the done byte up to `timeout` seconds."""
        with self._lock:
            if self.returncode is None:
                ready = select.select([self._done_fd], [], [], timeout)[0]
                if ready and os.read(self._done_fd, 1) == _DONE:
                    self.returncode = 0
                elif self.process.poll() is not None:  # it exited (the pipe's end of file): its status
                    self.returncode = self.process.returncode
            return self.returncode


class FollowerPool:
    """`size` processes, each started once, serving local ranks 1 .. size of the engines `start`
    builds while `patch` holds (an engine of more ranks than `size` + 1 gets the extra ones started
    as they are needed)."""

    def __init__(self, size: int):
        self._processes: dict[int, tuple[subprocess.Popen, int]] = {}
        self._ranks: dict[int, _PooledRank] = {}
        for local in range(1, size + 1):
            self._start(local)

    def patch(self, monkeypatch) -> None:
        import hylo.distributed.launch as launch

        monkeypatch.setattr(
            launch, "subprocess", types.SimpleNamespace(**vars(subprocess) | {"Popen": self.popen})
        )

    def popen(self, command: list[str]) -> _PooledRank:
        """The rank `command` (`start`'s worker command) would spawn, in local rank's pooled process."""
        assert command[1:3] == ["-m", "hylo.distributed.worker"], command
        args = command[3:]  # CONFIG_JSON RANK ADDRESS LOCAL_RANK
        local = int(args[3])
        process, done_fd = self._processes.get(local) or self._start(local)
        previous = self._ranks.get(local)
        if process.poll() is not None or (previous is not None and previous.poll() != 0):
            process.kill()  # it failed, was killed, or still follows an engine rank 0 left
            process.wait()
            process, done_fd = self._start(local)
        process.stdin.write(json.dumps(args) + "\n")
        process.stdin.flush()
        self._ranks[local] = _PooledRank(process, done_fd, command)
        return self._ranks[local]

    def close(self) -> None:
        for process, done_fd in self._processes.values():
            if process.poll() is None:
                process.stdin.close()  # end of input: the process exits
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            os.close(done_fd)
        self._processes.clear()

    def __enter__(self) -> FollowerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, local: int) -> tuple[subprocess.Popen, int]:
        if local in self._processes:
            os.close(self._processes[local][1])
        read_fd, write_fd = os.pipe()
        process = subprocess.Popen(
            [sys.executable, __file__, str(write_fd)], stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,)
        )
        os.close(write_fd)
        self._processes[local] = (process, read_fd)
        return self._processes[local]


def _serve(done_fd: int) -> None:
    """A pooled process: for each line of arguments on stdin, the worker's rank, then the done byte."""
    from hylo.config import EngineConfig
    from hylo.distributed.follower import follow
    from hylo.distributed.launch import join
    from hylo.engine.engine import Engine

    logger = logging.getLogger("hylo")
    for line in sys.stdin:
        settings, rank, address, local_rank = json.loads(line)
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", force=True
        )
        try:
            config = EngineConfig(**json.loads(settings))
            engine = Engine(config, ranks=join(config, int(rank), f"tcp://{address}", int(local_rank)))
            follow(engine)
            engine.close()  # its process groups too: the next engine joins new ones
        except BaseException:
            logger.exception("rank %s failed", rank)
            sys.stderr.flush()
            os._exit(1)  # as the worker: no waiting on collectives that will never complete
        os.write(done_fd, _DONE)
    os._exit(0)  # end of input: exit as the worker does, without finalisers (their teardown took ~2 s)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
