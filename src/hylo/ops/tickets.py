"""Ticket counters: how a launch's last program to finish learns that it is last, with no second launch.

A kernel whose programs each produce part of a result and whose last one to finish completes it (the MoE
decode's routing and combine, mHC's one-launch entry at decode sizes) takes a ticket per group of
programs: each program stores its part, then `tl.atomic_add(counter, 1, sem="acq_rel")`; the program
that draws `programs - 1` sees every part (acquire after their releases), completes the result, and
stores 0 back. So the counters are zero between launches and a CUDA graph replays such launches as they
are. Launches of one stream run one after another (a programmatic dependent launch waits for the one
before it ahead of its first ticket), so they share the stream's counters; each CUDA stream gets a set of
its own, so launches on different streams never share one.
"""

from __future__ import annotations

import torch

TICKET_SLOTS = 256  # counters per stream: the most any launch uses (the MoE down launch: one per column tile)
_SPARE_STREAMS = 8  # counter sets made at once, so a stream first seen during a graph capture finds one
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_SPARE: dict[torch.device, list[torch.Tensor]] = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The `TICKET_SLOTS` int32 ticket counters of the current stream of `device`, zero between launches.
    Counter sets are zeroed outside graph captures, a few at a time, and never freed: a captured graph
    keeps using the set of the stream it was captured on."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _TICKETS:
        spare = _SPARE.setdefault(device, [])
        if not spare:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # zeros made inside a capture would only be written when the graph replays
                raise RuntimeError(
                    "ticket counters: run one step on this device before capturing a CUDA graph, "
                    "so its counters are zeroed outside the capture"
                )
            sets = torch.zeros(_SPARE_STREAMS, TICKET_SLOTS, dtype=torch.int32, device=device)
            spare.extend(sets.unbind())
        _TICKETS[key] = spare.pop()
    return _TICKETS[key]
