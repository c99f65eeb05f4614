"""The torch reference of a fixed-shape batch's metadata, computed on the device from the request table."""

from __future__ import annotations

from typing import NamedTuple

import torch


class InFlight(NamedTuple):
    """Each sequence's first token of a fixed-shape step as uploaded, and where the step's forward
    reads it: `first [B]` is a token id, or `marker` where the token is the one the sequence's row
    sampled last and the host has not read yet (`last_sampled [rows]`, device); the resolved tokens go
    to `ids [B]` (any stride: the first input id of each sequence in the step's batch). With `after
    [B]` (0 or 1) a sequence starts after the commit of a verify step still in flight on its row: its
    prefix is `last_committed [rows]` positions longer than uploaded."""

    first: torch.Tensor
    marker: int
    last_sampled: torch.Tensor
    ids: torch.Tensor
    after: torch.Tensor | None = None
    last_committed: torch.Tensor | None = None


def resolve_in_flight(prefix: torch.Tensor, rows: torch.Tensor, in_flight: InFlight) -> torch.Tensor:
    """Write each sequence's first token to `in_flight.ids` and return the prefix lengths the step
    starts at (`InFlight`)."""
    f = in_flight
    f.ids.copy_(torch.where(f.first == f.marker, f.last_sampled[rows], f.first))
    if f.after is None:
        return prefix
    return prefix + f.after * f.last_committed[rows]


def uniform_metadata(
    prefix: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
    kpool: int,
    filler_row: int | None = None,
    lengths: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """On the device, what `ForwardBatch.build` computes for sequences of `width` tokens at device
    prefix lengths `prefix [B]` in table rows `rows [B]`: `positions`, `token_rows`, `new_slots`,
    `state_slots`, `completed_pools` (`B · ceil(width / kpool)` entries) and a `pool_table` as wide as
    the table.

    `completed_pools` lists, per sequence, the pools its tokens may complete; a listed pool that does
    not complete is replaced by the first pool of `filler_row` (a row nobody owns: a fixed-shape
    batch's scratch slot) or, without one, by the sequence's pool at `prefix`, which is incomplete
    before this forward, is masked out of `pool_table` until some forward completes it, and is
    recompressed by that forward: whatever this one writes to its pooled slot is never read. (When
    that pool does complete here, both entries compute the same key from the same entries.)

    With `lengths [B]` (device, 1 <= lengths[b] <= width) sequence b has that many new tokens and the
    rest of its width is padding: a padding token takes the position of the sequence's last token and
    writes the first slot of `filler_row` (required), so that no sequence ever reads it; the pools
    follow the real lengths."""
    if lengths is not None and filler_row is None:
        raise ValueError("lengths: padding tokens write the filler row, and none was given")
    device = req_to_token.device
    steps = torch.arange(width, device=device)
    positions = prefix[:, None] + steps
    end = prefix + width if lengths is None else prefix + lengths
    pools_after = end // kpool
    candidates = prefix[:, None] // kpool + torch.arange(-(-width // kpool), device=device)
    completes = candidates < pools_after[:, None]
    if filler_row is None:
        pool_rows, candidates = rows[:, None], torch.where(completes, candidates, prefix[:, None] // kpool)
    else:
        pool_rows = torch.where(completes, rows[:, None], filler_row)
        candidates = torch.where(completes, candidates, 0)
    completed = req_to_token[pool_rows, candidates * kpool].long() // kpool
    columns = torch.arange(req_to_token.shape[1] // kpool, device=device)
    pool_slots = req_to_token[rows[:, None], columns[None, :] * kpool].long() // kpool
    if lengths is None:
        new_slots = req_to_token[rows[:, None], positions]
    else:
        positions = torch.minimum(positions, end[:, None] - 1)
        real = steps[None, :] < lengths[:, None]
        new_slots = torch.where(real, req_to_token[rows[:, None], positions], req_to_token[filler_row, 0])
    return {
        "positions": positions.flatten(),
        # a copy: with one sequence an expanded flatten is a stride-0 view, and kernels index rows densely
        "token_rows": rows.repeat_interleave(width),
        "new_slots": new_slots.long().flatten(),
        "state_slots": rows,
        "completed_pools": completed.flatten(),
        "pool_table": torch.where(columns[None, :] < pools_after[:, None], pool_slots, -1),
    }
