"""A step's one device-to-host read: what the step computed, by name, copied to the host with one wait.

Every step ends with one read (`ModelRunner`): the picks, a verify step's acceptance, logprobs, the
prompt positions it scored, a constrained request's next drafts, whichever the step has, named in a
`StepRead`. `Reader.start` copies them into pinned host buffers without waiting (non-blocking copies
and one CUDA event after them); `PendingRead.wait` waits for that event and gives the same fields on
the host. Each engine owns one reader (made by its runner, emptied by `Engine.close`): two engines
stepping in turn never write into each other's unread buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Logprobs:
    """Logprobs of picked tokens: each one's own (`chosen`) and the top-n of the raw distribution at
    its position (`top_ids`, `top_values`, one more dimension of n)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    @classmethod
    def of(cls, result) -> Logprobs | None:
        """The logprobs of a `sampling.Sampled` or `verify.Acceptance` (None when none were asked)."""
        if result is None or result.chosen is None:
            return None
        return cls(result.chosen, result.top_ids, result.top_values)


@dataclass
class StepRead:
    """What a step reads back, on the device before `Reader.start` and on the host after
    `PendingRead.wait`; a field the step does not compute is None."""

    tokens: torch.Tensor | None = None  # the plain rows' picks `[rows]`
    token_logprobs: Logprobs | None = None  # theirs: chosen `[rows]`, top `[rows, n]`
    accepted: torch.Tensor | None = None  # drafts each verify block kept `[blocks]`
    emitted: torch.Tensor | None = None  # the blocks' tokens `[blocks, T]` (`verify.Acceptance`)
    block_logprobs: Logprobs | None = None  # theirs: chosen `[blocks, T]`, top `[blocks, T, n]`
    prompt_logprobs: Logprobs | None = None  # the prompt positions scored: chosen `[N]`, top `[N, n]`
    drafts: torch.Tensor | None = None  # the constrained requests' drafts for their next step

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors present, by field (`token_logprobs.chosen` for a field of a field)."""
        found = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Logprobs):
                found |= {f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(value)}
            elif value is not None:
                found[f.name] = value
        return found

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> StepRead:
        """The same fields holding `tensors` (named as `tensors()` names them) instead."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Logprobs):
                value = Logprobs(*(tensors[f"{f.name}.{g.name}"] for g in fields(value)))
            elif value is not None:
                value = tensors[f.name]
            values[f.name] = value
        return StepRead(**values)


@dataclass
class PendingRead:
    """Host copies of a step's results on their way (`Reader.start`); `wait` blocks until they are
    there. The copies stay valid until the reader's second read after this one starts."""

    copies: StepRead
    done: torch.cuda.Event | None

    def wait(self) -> StepRead:
        if self.done is not None:
            self.done.synchronize()
        return self.copies


class Reader:
    """One engine's device-to-host reads. Pinned buffers are reused by turn, field, shape and dtype
    (allocating pinned memory costs more than a step; after the first steps of each shape nothing is
    allocated). Two turns: an overlapped step's read may still be on its way while the host turns the
    read before it into Python values; a third read would overwrite the first's buffers.

    Safe to use when: one engine steps on it (reads of two engines would share turns), on one CUDA
    stream per device (the event is recorded on the current one)."""

    def __init__(self):
        self._pinned: dict[tuple[int, str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._done: dict[tuple[int, torch.device], torch.cuda.Event] = {}
        self._turn = 0

    def start(self, results: StepRead) -> PendingRead:
        """Start copying `results` to the host: non-blocking copies into this turn's pinned buffers and
        one event after them on CUDA (nothing waits yet), plain copies elsewhere."""
        present = results.tensors()
        first = next(iter(present.values()), None)
        if first is None or not first.is_cuda:
            return PendingRead(results.with_tensors({k: t.clone() for k, t in present.items()}), None)
        self._turn ^= 1
        copies = {}
        for name, t in present.items():
            key = (self._turn, name, tuple(t.shape), t.dtype)
            host = self._pinned.get(key)
            if host is None:
                host = self._pinned[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            copies[name] = host
        done = self._done.get((self._turn, first.device))
        if done is None:
            done = self._done[self._turn, first.device] = torch.cuda.Event()
        done.record(torch.cuda.current_stream(first.device))
        return PendingRead(results.with_tensors(copies), done)

    def read(self, results: StepRead) -> StepRead:
        """Host copies of `results`, with one wait for all of them (`start`)."""
        return self.start(results).wait()

    def close(self) -> None:
        """Give the pinned buffers and events back (a read still pending keeps its own copies)."""
        self._pinned.clear()
        self._done.clear()
