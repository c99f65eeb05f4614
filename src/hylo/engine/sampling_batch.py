"""A step's sampling batch from its scheduled requests: the one place that turns `Request`s into the
batch data `hylo.sampling.sample` and `speculative.verify.accept` read (they never see a request).

Built once per step, when the step samples: a step launched before the one ahead of it is read
samples after that one has been applied (`ModelRunner.sample_launched`), so its batch is built then,
from the requests' counters and grammars as they are at that point. What a row reads of its request
(output ids, seed, grammar) is read here and nowhere below.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hylo.engine.request import Request, Status
from hylo.sampling import SampleRow, SamplingBatch
from hylo.speculative.verify import VerifyBatch
from hylo.structured import allowed_tokens, block_bitmasks, fill_bitmasks


def sampling_batch(
    requests: Sequence[Request],
    vocab: int,
    device: torch.device,
    last_sampled: torch.Tensor | None = None,
    counted: bool = False,
) -> SamplingBatch:
    """One row per request picking its next token. `counted`: the requests' `in_flight` already
    counts this pick (a step launched before it samples); the in-flight tokens before it ban stop ids
    as if read, and a penalised row counts the one still on the device (`last_sampled`, the
    `CacheManager`'s) in its penalties. A request that ended meanwhile picks unconstrained (its pick
    is dropped)."""
    rows, grammars = [], []
    for r in requests:
        live = r.status is Status.RUNNING
        earlier = r.in_flight - counted  # in-flight tokens before this pick
        unread = _unread(r, earlier, last_sampled) if live else None
        rows.append(SampleRow(r.params, r.prompt_ids, r.output_ids, r.seed, r.banned_ids(earlier), unread))
        grammars.append(r.grammar if live else None)
    bitmasks = fill_bitmasks(grammars, vocab, device)
    return SamplingBatch(rows, None if bitmasks is None else allowed_tokens(bitmasks, vocab))


def verify_batch(
    requests: Sequence[Request], num_drafts: Sequence[int], width: int, vocab: int, device: torch.device
) -> VerifyBatch:
    """One verify block of `width` positions per request, `num_drafts[v]` of them real drafts. A
    constrained block masks each position after the drafts the host read before it
    (`Request.host_drafts`, `block_bitmasks`). Bans are decided as of the output the host has read:
    right for a verify step scheduled after a read; a block launched behind an unread verify step is
    launched only for rows whose acceptance reads no output (`InFlightLedger.run_ahead`)."""
    rows = [SampleRow(r.params, r.prompt_ids, r.output_ids, r.seed, r.banned_ids(0)) for r in requests]
    banned_picks = [r.params.min_tokens - len(r.output_ids) for r in requests]
    bitmasks = block_bitmasks([(r.grammar, r.host_drafts or []) for r in requests], width, vocab, device)
    allowed = None if bitmasks is None else allowed_tokens(bitmasks, vocab)
    return VerifyBatch(rows, list(num_drafts), banned_picks, allowed)


def _unread(request: Request, earlier: int, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
    """A penalised request's output token still in flight before this pick (on the device), which
    its penalties count; None when the host has read them all (or nothing penalises them)."""
    if not (earlier and request.params.penalized):
        return None
    assert earlier == 1 and request.slot is not None  # the step before this one's
    return last_sampled[request.slot : request.slot + 1]
