"""Accepting draft tokens on the device: greedy prefix match, or lossless rejection sampling.

Glossary (one verify block = the anchor followed by its drafts, `T` tokens at most):
- anchor: the request's last token, picked by the previous step and not yet fed to the target.
- draft j: the proposer's guess for the token after draft j−1 (after the anchor for j = 0).
- accepted: how many drafts the target keeps, from the first: a greedy row keeps drafts equal to its
  argmax; a sampled row keeps draft x with probability p(x) under its processed distribution p.
- recovered token: what replaces the first rejected draft (greedy: the argmax; sampled: a sample from
  p with the draft removed and renormalised).
- bonus token: what follows when every draft is accepted (greedy: the argmax; sampled: a sample of p).
- emitted: the accepted drafts, then the recovered or bonus token: `accepted + 1` tokens, the block's
  new output; `committed = accepted + 1` block tokens (the anchor and the accepted drafts) enter the
  target's caches.
Either way the emitted tokens are distributed exactly as plain sampling would make them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hylo.host_copy import to_device
from hylo.sampling import RowsOfAStep, SampleRow, target_distribution

# The KDA verify kernels run one block of at most 16 tokens per sequence (`hylo.ops.kda`).
MAX_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class VerifyShape:
    """The verify block of an engine's speculative steps: the anchor and `drafts = block - 1` drafts.

    One per engine, declared by its proposer (`Proposer.verify_shape`) and handed as is to the
    scheduler, the verify graphs and the draft-length policy: the one name for the block width from
    the command line inwards (`--speculative-num-draft-tokens`, SGLang's flag, is `block`; a DFlash
    draft's `block_size` too). Invariant: `block >= 2`, the anchor and at least one draft. A chunk may
    verify fewer drafts than the shape holds (its request's draft budget, `ScheduledChunk.num_tokens`)."""

    block: int

    def __post_init__(self) -> None:
        if self.block < 2:
            raise ValueError(
                f"block: a verify block holds the anchor and at least one draft, got {self.block}"
            )

    @property
    def drafts(self) -> int:
        """The drafts a block holds after its anchor (a proposer's draft rows are this wide)."""
        return self.block - 1


@dataclass(frozen=True)
class VerifyBatch(RowsOfAStep):
    """What `accept` reads of V verify blocks (vLLM's `SpecDecodeMetadata` with its sampling rows),
    built once per step by the engine from its scheduled requests (`verify_batch` in
    `engine/sampling_batch.py`); it holds no request.

    Invariants: `rows[v]` is block v's sampling row as of its anchor's pick (banned ids those in force
    then); `num_drafts[v]` its real drafts (positions past them are padding); `banned_picks[v]` how
    many picks from the block's first its banned ids bind (`min_tokens` not reached before them: 0 or
    less when none does); `allowed` is None (no block constrained) or `[V·T, vocab]` bool, position i
    of block v allowing what its grammar allows after the block's drafts before i
    (`hylo.structured.block_bitmasks`)."""

    rows: Sequence[SampleRow]
    num_drafts: Sequence[int]
    banned_picks: Sequence[int]
    allowed: torch.Tensor | None = None

    def position_rows(self, width: int) -> list[SampleRow]:
        """One row per position of blocks of `width` (block-major): position i is processed as if
        min(i, drafts) tokens had already been generated, so a `min_tokens` ban moves along the block."""
        return [
            row if min(i, n) < banned else replace(row, banned_ids=[])
            for row, n, banned in zip(self.rows, self.num_drafts, self.banned_picks, strict=True)
            for i in range(width)
        ]


@dataclass
class Acceptance:
    """Device results for V blocks padded to T tokens. `accepted [V]`: drafts kept; `emitted [V, T]`:
    the first `accepted[v] + 1` entries of row v are its emitted tokens (the rest is unspecified).
    With logprobs asked for: `chosen [V, T]` the emitted tokens' logprobs and `top_ids`/`top_values`
    `[V, T, n]` the top-n of the raw distribution at each position."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None


def greedy_accept(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Drafts kept per row: the longest prefix of `drafts [V, T-1]` equal to the target's argmax
    `target [V, T]`, among the first `num_drafts [V]`."""
    steps = torch.arange(drafts.shape[1], device=drafts.device)
    keep = (target[:, :-1] == drafts) & (steps[None, :] < num_drafts[:, None])
    return keep.int().cumprod(1).sum(1)


def accept(
    logits: torch.Tensor, drafts: torch.Tensor, blocks: VerifyBatch, generator: torch.Generator | None
) -> Acceptance:
    """`logits [V, T, vocab]` (fp32) at the anchor and each draft of the V blocks of `blocks`,
    `drafts [V, T-1]` on the device. Position i's distribution is processed as if i tokens had already
    been generated (`VerifyBatch.position_rows`) and masked by `blocks.allowed` (structured outputs),
    so a draft the grammar refuses is never accepted. `generator` draws the noise of sampled blocks
    without one of their own. Nothing is read back to the host."""
    num_blocks, width, vocab = logits.shape
    assert width <= MAX_BLOCK_TOKENS, f"a verify block holds at most {MAX_BLOCK_TOKENS} tokens, got {width}"
    device = logits.device
    counts = to_device(list(blocks.num_drafts), device)
    steps = torch.arange(width, device=device)
    padded_drafts = torch.cat([drafts, drafts.new_zeros(num_blocks, 1)], 1)
    if blocks.picks_argmax:
        target = logits.argmax(-1)
        accepted = greedy_accept(target, drafts, counts)
        emitted = torch.where(steps[None, :] < accepted[:, None], padded_drafts, target)
        return _with_logprobs(Acceptance(accepted, emitted), logits, blocks)
    processed, probs = target_distribution(logits.flatten(0, 1), blocks.position_rows(width), blocks.allowed)
    flat_drafts = padded_drafts.flatten()
    uniforms, exps = _noise(blocks, width, vocab, device, generator)
    greedy = to_device([r.params.greedy for r in blocks.rows], device)[:, None]
    target = processed.argmax(-1).view(num_blocks, width)
    draft_probs = probs.gather(1, flat_drafts[:, None])[:, 0]
    sampled_pass = (uniforms < draft_probs).view(num_blocks, width)[:, :-1]
    passes = torch.where(greedy, target[:, :-1] == drafts, sampled_pass)
    valid = steps[None, :-1] < counts[:, None]
    accepted = (passes & valid).int().cumprod(1).sum(1)
    bonus = (probs / exps).argmax(-1).view(num_blocks, width)  # a sample from p (exponential race)
    recovered = (probs.scatter(1, flat_drafts[:, None], 0.0) / exps).argmax(-1).view(num_blocks, width)
    sampled = torch.where(steps[None, :] < counts[:, None], recovered, bonus)
    picks = torch.where(greedy, target, sampled)
    emitted = torch.where(steps[None, :] < accepted[:, None], padded_drafts, picks)
    return _with_logprobs(Acceptance(accepted, emitted), logits, blocks)


def _with_logprobs(result: Acceptance, logits: torch.Tensor, blocks: VerifyBatch) -> Acceptance:
    """Top-n logprobs of the raw distribution at every block position, and the emitted tokens' own."""
    top_n = blocks.max_logprobs
    if top_n is None:
        return result
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    result.chosen = logprobs.gather(2, result.emitted[..., None])[..., 0]
    top = logprobs.topk(top_n, dim=-1)
    result.top_ids, result.top_values = top.indices, top.values
    return result


def _noise(
    blocks: VerifyBatch, width: int, vocab: int, device, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for the accept tests and Exp(1) noise for the samples, `num_drafts[v] + 1` of each per
    block, drawn from each block's own generator when it has one (so a seeded request does not
    depend on its batch); padding positions get ones (never read)."""
    uniforms = torch.ones(len(blocks.rows), width, device=device)
    exps = torch.ones(len(blocks.rows), width, vocab, device=device)
    for v, (row, n) in enumerate(zip(blocks.rows, blocks.num_drafts, strict=True)):
        gen = row.generator or generator
        uniforms[v, : n + 1] = torch.rand(n + 1, device=device, generator=gen)
        exps[v, : n + 1] = torch.empty(n + 1, vocab, device=device).exponential_(generator=gen)
    return uniforms.flatten(), exps.flatten(0, 1)
