"""`python -m hylo.distributed.worker CONFIG_JSON RANK ADDRESS LOCAL_RANK`: one rank other than 0 of an
engine, started by rank 0's process (`hylo.distributed.launch.start`): it builds the engine on its
shard and follows rank 0 until told to stop. Exit status 1 when anything fails."""

from __future__ import annotations

import json
import logging
import os
import sys

from hylo.config import EngineConfig
from hylo.distributed.launch import join

logger = logging.getLogger("hylo")


def main(argv: list[str]) -> None:
    settings, rank, address, local_rank = argv
    rank, local_rank = int(rank), int(local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        from hylo.distributed.follower import follow
        from hylo.engine.engine import Engine

        config = EngineConfig(**json.loads(settings))
        engine = Engine(config, ranks=join(config, rank, f"tcp://{address}", local_rank))
        follow(engine)
    except BaseException:
        logger.exception("rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)  # no atexit handlers, no waiting on collectives that will never complete
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
