"""A request as the engine tracks it, from arrival to its finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from hylo.sampling import SamplingParams
from hylo.tokenizer import IncrementalDetokenizer

# What `Request.tokens` gives for a position whose token is still in flight (sampled on the device,
# not yet read): never a vocabulary id.
IN_FLIGHT = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Metrics:
    """Times, and with speculative decoding the verify steps and the drafts they accepted;
    the acceptance length τ = tokens committed per verify step (accepted drafts + 1)."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.spec_verify_steps:
            return None
        return 1 + self.spec_accepted_tokens / self.spec_verify_steps


@dataclass(eq=False)  # an entity: it equals only itself, so queues find it without comparing fields
class Request:
    """One sequence to complete. `num_computed` tokens of `prompt_ids + output_ids` and the
    `in_flight` tokens after them are in the caches, or on their way there; the next forward feeds
    the rest (all of it after a preemption, which empties the caches).

    Who writes what: the scheduler alone writes the counters `num_computed`, `in_flight`,
    `verifying`, `deferred_from`, `host_drafts` and `undrafted` (its ledger, `InFlightLedger`, as steps are
    launched and settled; itself on admission and preemption) and the `slot` and `pages`; the engine
    appends the tokens read (`append`, which may finish the request) and ends it (`finish`). The
    runner, the route and everything below them only read a request.

    `in_flight`: output tokens a step run ahead has sampled on the device that the host has not
    read yet (the overlap schedule: at most two, one step's and the next's). Their
    positions follow `output_ids`; a chunk that feeds one reads it from the device
    (`CacheManager.last_sampled`): `tokens` gives `IN_FLIGHT` there.

    `verifying`: overlapped verify steps launched and not read yet (at most two). How many positions
    the first of them commits and which tokens it emits are on the device only: until it is read,
    `num_computed` and `output_ids` stop before its block, and the block launched behind it starts at
    the device's committed length (`SequenceChunk.after_commit`) from the anchor it left
    (`CacheManager.last_sampled`).

    Invariant: a RUNNING request holds a slot and pages for at least `num_computed` positions;
    a WAITING or FINISHED one holds neither. With a proposer, positions `deferred_from ..
    num_computed - 1` (fewer than the decode graphs' `deferred_tokens`) are committed but not yet
    observed. A request with tokens in flight is never preempted (only a step with none in flight
    is scheduled by `Scheduler.schedule`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_total_len: int
    detokenizer: IncrementalDetokenizer | None = None
    # the sampling seed: `params.seed` (+ i for sequence i of n), else drawn by the engine at arrival
    seed: int = 0
    # with a structured-output constraint: its xgrammar matcher, fed every output token (`append`)
    grammar: Any = None
    # a constrained request's drafts after its last token, as the last step read them (None: none)
    host_drafts: list[int] | None = None
    # the proposer drafted nothing after the request's last step (a prefill-graph replay, which
    # leaves the first drafts to the step after it): its next block holds its anchor alone
    undrafted: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # with `params.prompt_logprobs`: entry j is prompt position j + 1's (position 0 has none)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    num_computed: int = 0
    in_flight: int = 0
    verifying: int = 0
    # the first committed position the proposer has not observed (its target features wait in the
    # decode graphs' deferred ring, `DecodeGraphs.deferred`); None when it has seen every one
    deferred_from: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    metrics: Metrics = field(default_factory=lambda: Metrics(time.time()))
    _held_text: str = ""

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next sample."""
        return self.total_len + self.in_flight - self.num_computed

    def tokens(self, start: int, stop: int) -> list[int]:
        """The tokens of positions `start .. stop - 1`, `IN_FLIGHT` for those still in flight."""
        n, total = len(self.prompt_ids), self.total_len
        unread = [IN_FLIGHT] * (min(stop, total + self.in_flight) - max(start, total))
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n) : stop - n] + unread

    def draft_budget(self, max_drafts: int) -> int:
        """Drafts worth verifying: never past max_tokens or the length limit; none for penalized
        sampling, whose distribution depends on the tokens before it in the block, and none for a
        constrained request whose drafts the host has not seen (its grammar masks each position
        after the drafts before it), none when the proposer drafted nothing after the last step."""
        if self.undrafted or self.params.penalized or (self.grammar is not None and self.host_drafts is None):
            return 0
        return max(0, min(max_drafts, self.tokens_left - 1))

    @property
    def tokens_left(self) -> int:
        """Output tokens before `max_tokens` or the length limit ends the request (tokens in flight
        not counted)."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_total_len - self.total_len)

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are asked and some prompt position (from 1) is not scored yet."""
        scored = len(self.prompt_logprobs) + 1  # position 0 has no logprob
        return self.params.prompt_logprobs is not None and scored < len(self.prompt_ids)

    def prompt_targets(self, start: int, num_tokens: int) -> tuple[int, list[int]]:
        """(first position, tokens): the prompt tokens a chunk of `num_tokens` from position `start`
        scores, each predicted from the position before it: positions `start + 1 ..` up to the
        prompt's end, less those already scored (a recompute after preemption adds nothing). Their
        entries extend `prompt_logprobs` in order."""
        if not self.scores_prompt:
            return 0, []
        first = max(start + 1, len(self.prompt_logprobs) + 1)
        return first, self.prompt_ids[first : min(start + num_tokens + 1, len(self.prompt_ids))]

    @property
    def picks_argmax(self) -> bool:
        """The next pick is the argmax of the model's own logits (`raw_argmax`, no `min_tokens` ban)."""
        return self.params.raw_argmax and not self.banned_ids()

    def banned_ids(self, in_flight: int | None = None) -> list[int]:
        """Stop ids may not be sampled before `min_tokens` tokens exist: `output_ids` and the tokens in
        flight before this pick (`in_flight`, by default all of this request's)."""
        produced = len(self.output_ids) + (self.in_flight if in_flight is None else in_flight)
        return sorted(self.stop_ids) if produced < self.params.min_tokens else []

    def append(self, token: int, logprobs: dict[int, float] | None) -> str:
        """Record a sampled token; decide whether the request is finished. Returns the new text that
        is final (text that might still turn out to start a stop string is held back)."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()
        self.output_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        new_text = self.detokenizer.step([token]) if self.detokenizer is not None else ""
        pending = self._held_text + new_text
        if self.grammar is not None and not self.grammar.accept_token(token):
            raise ValueError(f"token {token} breaks the request's {self.params.constraint[0]} constraint")
        if token in self.stop_ids and len(self.output_ids) >= self.params.min_tokens:
            return self._finish("stop", pending)
        if self.grammar is not None and self.grammar.is_terminated():  # the output is complete
            return self._finish("stop", pending)
        if self.params.stop and len(self.output_ids) >= self.params.min_tokens:
            cut = self._stop_string_cut(pending)
            if cut is not None:
                return self._finish("stop", pending[:cut])
        if len(self.output_ids) >= self.params.max_tokens or self.total_len >= self.max_total_len:
            return self._finish("length", pending)
        hold = self._hold_length(pending)
        emit, self._held_text = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self.text += emit
        return emit

    def _stop_string_cut(self, pending: str) -> int | None:
        """Where the output text ends if a stop string completed in `pending`. Emitted text never ends
        in a proper prefix of a stop string (see `_hold_length`), so a stop string that completes now
        starts inside `pending`."""
        hits = [(i, stop) for stop in self.params.stop if (i := pending.find(stop)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        return index + (len(stop) if self.params.include_stop_str_in_output else 0)

    def _hold_length(self, pending: str) -> int:
        """Longest suffix of the text that is a proper prefix of some stop string."""
        longest = 0
        full = self.text + pending
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(full)), longest, -1):
                if full.endswith(stop[:k]):
                    longest = k
                    break
        return min(longest, len(pending))

    def _finish(self, reason: str, final_text: str) -> str:
        self.text += final_text
        self._held_text = ""
        self.finish(reason)
        return final_text

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = time.time()
