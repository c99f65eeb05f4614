"""Tensor and expert parallelism as the layers and the engine see it: who holds what, and how one
process's rank talks to the others.

- `layout`: `Parallel`, this rank's share (rank, size, how the experts are split) and the device
  collectives the layers call; `StandInCollectives` / `CollectiveCall` record them for a rank
  measured alone.
- `sharding`: what each rank reads of every checkpoint tensor, by name (the loader's table).
- `ranks`: `Ranks`, this process's rank as the engine holds it (device, host group, start-up
  exchanges, the rank processes it started, closing them).
- `control`: the step messages rank 0 publishes (`Publisher`: arrivals, aborts, the step plan) and
  the other ranks `receive`.

Layer: below `layers` (see `hylo`'s docstring); imports `config` and `sampling` only. Starting the
ranks and following rank 0 need the engine: they are `hylo.distributed`, above it.
"""
