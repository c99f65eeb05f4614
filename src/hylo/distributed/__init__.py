"""Running one engine over several ranks, above the engine.

- `launch`: starts or joins the ranks (spawned `python -m hylo.distributed.worker` processes, several
  hosts, or `torchrun`) and returns the `hylo.parallel.ranks.Ranks` the engine is built on; notices a
  lost rank.
- `worker`: a spawned rank's main: builds its engine on its shard and follows rank 0.
- `follower`: steps a rank's engine by what rank 0 publishes (`hylo.parallel.control`).
- `rank_engine`: one rank of a TP/EP engine alone on one device, its collectives recorded, for
  measuring.

Layer: above `engine`, below `server`, `llm` and `bench` (see `hylo`'s docstring). What the layers
and the engine use of parallelism (layout, sharding, the rank handle, the step messages) is
`hylo.parallel`, below the layers.
"""
