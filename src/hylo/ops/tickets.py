"""Ticket counters: how the last program of a launch to finish a piece of work finds out, with no waiting.

A kernel whose programs each produce part of a result (split-K partials, a column tile's row blocks, the
projection splits of an mHC entry) can let the program that arrives last finish it in the same launch: each
program stores its part, then takes a ticket (`tl.atomic_add(counter, 1, sem="acq_rel")`); the one that
draws `parts - 1` sees every other program's stores (their release, its acquire) and puts the counter back
to zero. No program ever waits for another, so the result never depends on timing or on which programs
are resident, and a CUDA graph replays the launch as it is.

The contract, safe to use when every kernel keeps it: a counter is zero between launches (the last ticket
resets it), and tickets are taken after `enter(PDL)` (`ops.dependent_launch`), so a dependent launch never
touches counters the kernel before it still uses. Each CUDA stream gets its own set (`tickets`): launches
on different streams never share a counter, launches of one stream run one after another, so every family
draws from the same set, from counter 0 on.
"""

from __future__ import annotations

import torch

# counters per stream: the most any launch takes (MoE decode's split gate|up: up to 1104 at GLM-5.3-Flash's
# sizes, `ops.moe.decode`)
TICKET_SLOTS = 2048
_SPARE_STREAMS = 8  # counter sets made at once, so a stream first seen during a graph capture finds one
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_SPARE: dict[torch.device, list[torch.Tensor]] = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The int32 ticket counters of the current stream of `device`, zero between launches. Counter
    sets are zeroed outside graph captures, a few at a time, and never freed: a captured graph keeps
    using the set of the stream it was captured on."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _TICKETS:
        spare = _SPARE.setdefault(device, [])
        if not spare:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # zeros made inside a capture would only be written when the graph replays
                raise RuntimeError(
                    "ticket counters: run one decode step on this device before capturing a CUDA graph, "
                    "so its counters are zeroed outside the capture"
                )
            sets = torch.zeros(_SPARE_STREAMS, TICKET_SLOTS, dtype=torch.int32, device=device)
            spare.extend(sets.unbind())
        _TICKETS[key] = spare.pop()
    return _TICKETS[key]
