"""From a forward's logits to a step's picks on the device, and from their read to one result per chunk.

A step's chunks own rows of its logits (`PickLayout`): a plain chunk that samples picks one token
from its last row (`sample_plain`, over the step's `SamplingBatch`), a verify chunk accepts a prefix
of its block's drafts (`accept_blocks`, over its `VerifyBatch`, then the KDA commit of what it
kept), a chunk that scores prompt positions turns its rows into prompt logprobs (`score_prompts`).
All of it is device work: nothing is read back here. The step's one read (`StepRead`, `step_read`)
comes back to `step_results`, `verify_results` or `launched_results`, which make the `ChunkResult`s.

The picks also fill in the step's `StepCommit` for the proposer where it has one (`DraftDriver`):
the plain picks are their rows' anchors, a verify block's committed count and last emitted token
its row's count and anchor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.reader import Logprobs, StepRead
from hylo.engine.request import Request
from hylo.engine.sampling_batch import sampling_batch, verify_batch
from hylo.forward_batch import ForwardBatch
from hylo.host_copy import to_device
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.sampling import Sampled, logprob_entry, sample
from hylo.speculative.proposer import StepCommit
from hylo.speculative.verify import Acceptance, accept


@dataclass
class ChunkResult:
    """Tokens the target picked after a chunk (one, or a verify step's accepted drafts + one) and
    how many of the chunk's tokens are now committed to the caches."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    committed: int
    accepted: int = 0
    # prompt logprobs the chunk scored, to extend `Request.prompt_logprobs` (Request.prompt_targets)
    prompt_logprobs: list[dict[int, float]] | None = None
    # a constrained request's drafts for its next step (`Request.host_drafts`), None if none were made
    drafts: list[int] | None = None


@dataclass(frozen=True)
class PickLayout:
    """Which rows of a step's logits each chunk owns and what it does with them, made once per step.

    Invariants: `rows_of[i]` are chunk i's rows (see `ForwardBatch.logits_index`): every token's for a
    verify chunk and a chunk that scores prompt positions, else the sampled one's (none for a prefill
    chunk that does not reach its prompt's end); `targets[i]` the (first position, tokens) chunk i
    scores (`Request.prompt_targets`); `plain`, `verifying` and `scoring` list the chunks that sample
    one token, verify a block and score prompt positions, in order."""

    targets: list[tuple[int, list[int]]]
    rows_of: list[list[int]]
    plain: list[int]
    verifying: list[int]
    scoring: list[int]

    @classmethod
    def of(cls, chunks: Sequence[ScheduledChunk], targets: Sequence[tuple[int, list[int]]]) -> PickLayout:
        rows_of, n = [], 0
        for ch, (_, scored) in zip(chunks, targets, strict=True):
            count = ch.num_tokens if ch.verify or scored else int(ch.samples)
            rows_of.append(list(range(n, n + count)))
            n += count
        plain = [i for i, ch in enumerate(chunks) if ch.samples and not ch.verify]
        verifying = [i for i, ch in enumerate(chunks) if ch.verify]
        scoring = [i for i, (_, tokens) in enumerate(targets) if tokens]
        return cls(list(targets), rows_of, plain, verifying, scoring)


def prompt_targets(chunk: ScheduledChunk) -> tuple[int, list[int]]:
    """(first position, tokens) of the prompt positions `chunk` scores (none for a verify chunk)."""
    if chunk.verify:
        return 0, []
    return chunk.request.prompt_targets(chunk.request.num_computed, chunk.num_tokens)


def pick_positions(batch: ForwardBatch, rows: int) -> torch.Tensor:
    """Where in its sequence the pick after each of the first `rows` logits rows of `batch`'s forward
    goes (the position after that row's token): the counter of its seeded noise (`sampling.pick`)."""
    return batch.positions[batch.logits_index[:rows]] + 1


def sample_plain(
    chunks: Sequence[ScheduledChunk],
    layout: PickLayout,
    forward_batch: ForwardBatch,
    logits: torch.Tensor,
    last_sampled: torch.Tensor,
    commit: StepCommit | None,
) -> Sampled | None:
    """The picks of the plain sampling chunks (None without any), each from its chunk's last row (a
    scoring chunk's last row samples) of `logits`, the forward of `forward_batch`; they are their
    rows' anchors in `commit`."""
    plain = layout.plain
    if not plain:
        return None
    device = logits.device
    batch = sampling_batch([chunks[i].request for i in plain], logits.shape[-1], device, last_sampled)
    positions = pick_positions(forward_batch, logits.shape[0])
    picked_rows = [layout.rows_of[i][-1] for i in plain]
    if picked_rows == list(range(len(picked_rows))):  # a decode step: no index upload
        picked = sample(logits[: len(plain)], batch, positions[: len(plain)])
    else:
        rows = to_device(picked_rows, device, torch.long)
        picked = sample(logits[rows], batch, positions[rows])
    if commit is not None and plain == list(range(len(plain))):
        commit.anchors[: len(plain)] = picked.tokens
    elif commit is not None:  # (indexing by a list would upload it from pageable memory)
        commit.anchors[to_device(plain, device, torch.long)] = picked.tokens
    return picked


def sample_launched(
    chunks: Sequence[ScheduledChunk],
    forward_batch: ForwardBatch,
    logits: torch.Tensor,
    last_sampled: torch.Tensor,
    counted: bool,
) -> Sampled:
    """The picks of a plain decode step launched ahead of its read (`logits [rows, vocab]` of the
    forward of `forward_batch`, one row a chunk; `counted`: as `sampling_batch` takes it), each
    written to its request-table row of
    `last_sampled`, where the next step's in-flight token comes from (not for a request that ended
    meanwhile and gave its row back: its pick is dropped)."""
    requests = [ch.request for ch in chunks]
    batch = sampling_batch(requests, logits.shape[-1], logits.device, last_sampled, counted)
    picked = sample(logits, batch, pick_positions(forward_batch, logits.shape[0]))
    held = [i for i, r in enumerate(requests) if r.slot is not None]  # not those that ended meanwhile
    slots = to_device([requests[i].slot for i in held], logits.device, torch.long)
    if len(held) == len(requests):
        last_sampled[slots] = picked.tokens
    else:
        last_sampled[slots] = picked.tokens[to_device(held, logits.device, torch.long)]
    return picked


def accept_blocks(
    chunks: Sequence[ScheduledChunk],
    layout: PickLayout,
    batch: ForwardBatch,
    forward: ForwardOutput,
    model: Glm5NextForCausalLM,
    commit: StepCommit | None,
) -> Acceptance | None:
    """The acceptance of the verify chunks' blocks (None without any), padded to the widest, from
    the logits of `forward` (the step's forward of `batch`), and the KDA commit of what each kept;
    each block's committed count and anchor go to `commit`."""
    verifying = layout.verifying
    if not verifying:
        return None
    logits = forward.logits
    device = logits.device
    width = max(chunks[i].num_tokens for i in verifying)
    rows_of = layout.rows_of
    index = [[rows_of[i][min(j, len(rows_of[i]) - 1)] for j in range(width)] for i in verifying]
    index_d = to_device(index, device, torch.long)
    drafts = batch.input_ids[index_d[:, 1:]]
    blocks = verify_blocks([chunks[i] for i in verifying], width, model)
    positions = pick_positions(batch, logits.shape[0])[index_d]
    acceptance = accept(logits[index_d], drafts, blocks, positions)
    model.commit(batch, forward.kda_records, acceptance.committed)
    if commit is not None:
        verify_index = to_device(verifying, device, torch.long)
        commit.counts[verify_index] = acceptance.committed
        commit.anchors[verify_index] = acceptance.anchors
    return acceptance


def verify_blocks(chunks: Sequence[ScheduledChunk], width: int, model: Glm5NextForCausalLM):
    """What acceptance reads of the verify chunks' blocks of `width` (`verify_batch`), its grammar
    masks over the model's vocabulary on its device."""
    requests, num_drafts = [ch.request for ch in chunks], [ch.num_drafts for ch in chunks]
    device = model.embed_tokens.weight.device
    return verify_batch(requests, num_drafts, width, model.config.vocab_size, device)


def score_prompts(
    logits: torch.Tensor, chunks: Sequence[ScheduledChunk], layout: PickLayout
) -> Logprobs | None:
    """The logprobs (chosen `[N]`, top `[N, n]`) of the prompt positions the chunks score, in order, n
    the largest `prompt_logprobs` asked; nothing is read back. None when no chunk scores."""
    if not layout.scoring:
        return None
    rows, tokens = [], []
    for i in layout.scoring:
        first, chunk_tokens = layout.targets[i]
        lead = first - 1 - chunks[i].request.num_computed  # the logits row of position first - 1
        rows += layout.rows_of[i][lead : lead + len(chunk_tokens)]
        tokens += chunk_tokens
    index = to_device([rows, tokens], logits.device, torch.long)
    logprobs = torch.log_softmax(logits[index[0]].float(), dim=-1)
    top = logprobs.topk(max(chunks[i].request.params.prompt_logprobs for i in layout.scoring), dim=-1)
    return Logprobs(logprobs.gather(1, index[1][:, None])[:, 0], top.indices, top.values)


def step_read(
    picked: Sampled | None,
    acceptance: Acceptance | None,
    prompt_logprobs: Logprobs | None,
    drafts: torch.Tensor | None,
) -> StepRead:
    """What an eagerly picked step reads back: its picks, acceptance, prompt logprobs and drafts."""
    return StepRead(
        tokens=picked.tokens if picked else None,
        token_logprobs=Logprobs.of(picked),
        accepted=acceptance.accepted if acceptance else None,
        emitted=acceptance.emitted if acceptance else None,
        block_logprobs=Logprobs.of(acceptance),
        prompt_logprobs=prompt_logprobs,
        drafts=drafts,
    )


def step_results(chunks: Sequence[ScheduledChunk], layout: PickLayout, read: StepRead) -> list[ChunkResult]:
    """One result per chunk of an eagerly picked step, from its read (`step_read`'s fields)."""
    results = [ChunkResult([], None, ch.num_tokens) for ch in chunks]
    for k, i in enumerate(layout.plain):
        token = int(read.tokens[k])
        lp = _entries(chunks[i].request, [token], read.token_logprobs, k)
        results[i] = ChunkResult([token], lp, chunks[i].num_tokens)
    for k, i in enumerate(layout.verifying):
        accepted = int(read.accepted[k])
        tokens = read.emitted[k, : accepted + 1].tolist()
        lp = _entries(chunks[i].request, tokens, read.block_logprobs, k)
        results[i] = ChunkResult(tokens, lp, accepted + 1, accepted)
    offset, prompt = 0, read.prompt_logprobs
    for i in layout.scoring:
        tokens = layout.targets[i][1]
        n = chunks[i].request.params.prompt_logprobs
        results[i].prompt_logprobs = [
            logprob_entry(t, float(prompt.chosen[offset + j]), prompt.top_ids[offset + j, :n].tolist(),
                          prompt.top_values[offset + j, :n].tolist(), n)
            for j, t in enumerate(tokens)
        ]  # fmt: skip
        offset += len(tokens)
    return results


def verify_results(chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
    """One result per verify chunk from the host copies of its acceptance (`read`). A block padded
    past a request's draft budget (its chunk's `num_tokens`) ends the request this step (greedy rows
    verify its placeholder drafts too): its tokens stop at the budget (what the caches hold past it
    belongs to nobody once it finishes)."""
    results = []
    for i, ch in enumerate(chunks):
        n = min(int(read.accepted[i]) + 1, ch.num_tokens)
        tokens = read.emitted[i, :n].tolist()
        results.append(ChunkResult(tokens, _entries(ch.request, tokens, read.block_logprobs, i), n, n - 1))
    return results


def launched_results(chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
    """One result per chunk of a plain decode step launched ahead of its read: its one pick."""
    results = []
    for k, ch in enumerate(chunks):
        token = int(read.tokens[k])
        results.append(ChunkResult([token], _entries(ch.request, [token], read.token_logprobs, k), 1))
    return results


def _entries(
    request: Request, tokens: list[int], logprobs: Logprobs | None, k: int
) -> list[dict[int, float]] | None:
    """Host logprob dicts of row `k` of a read's logprobs (`StepRead.token_logprobs`, `block_logprobs`)."""
    n = request.params.logprobs
    if n is None or logprobs is None:
        return None
    chosen, top_ids, top_values = logprobs.chosen, logprobs.top_ids, logprobs.top_values
    # row k: one position (a plain sample, `[n]`) or a verify block's positions (`[T, n]`); n may be 0
    chosen, top_ids, top_values = chosen[k].reshape(-1), top_ids[k], top_values[k]
    if top_ids.dim() == 1:
        top_ids, top_values = top_ids[None], top_values[None]
    return [
        logprob_entry(t, float(chosen[j]), top_ids[j].tolist(), top_values[j].tolist(), n)
        for j, t in enumerate(tokens)
    ]
