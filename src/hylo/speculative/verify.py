"""Accepting draft tokens on the device: one rule for greedy and sampled rows, which commits exactly the
tokens plain decoding would pick.

Glossary (one verify block = the anchor followed by its drafts, `T` tokens at most):
- anchor: the request's last token, picked by the previous step and not yet fed to the target.
- draft j: the proposer's guess for the token after draft j−1 (after the anchor for j = 0).
- pick i: what the target picks after block tokens 0..i, from its processed distribution p_i there
  (`hylo.sampling.pick`): a greedy row's argmax, a sampled row's Gumbel-max argmax_t p_i(t) / E(t)
  with the noise E of (the request's seed, the position the pick takes in the sequence). It is the
  rule, and the noise, that plain decoding uses at that position.
- accepted: how many drafts the target keeps: the longest prefix of the real drafts equal to the
  picks (draft j kept iff pick j is draft j and drafts 0..j−1 were kept).
- emitted: picks 0..accepted: the accepted drafts (equal to their picks), then the pick after them,
  which replaces the first rejected draft (the recovered token) or follows the last draft (the bonus
  token); `committed = accepted + 1` block tokens (the anchor and the accepted drafts) enter the
  target's caches.

Why a verify step commits plain decoding's tokens, whatever the schedule. Write y_k for the token
plain decoding picks at output position k: y_k = pick(p_k(· | y_<k), E_k), E_k the noise of
(seed, k). Take a block whose anchor is the last committed token, after committed y_<k, and show by
induction on i that an emitted pick i is y_{k+i}. The target's logits at block position i are
computed causally from y_<k and drafts 0..i−1 alone. Pick i is emitted only if drafts 0..i−1 were
accepted, i.e. draft j equals pick j = y_{k+j} (induction) for j < i: the target conditioned on
y_<k+i, so (with the `min_tokens` bans of `VerifyBatch.position_rows` and the grammar masks after the
drafts before i, as plain decoding has them there) its distribution is p_{k+i}(· | y_<k+i), its noise
E_{k+i}, and pick i is y_{k+i}. So the committed tokens are a function of the seed and the model
alone: the same with speculation on or off, whichever steps the draft-length policy made verify
steps, with the overlap schedule or not, in any batch. (Requests with penalties verify no drafts:
their p_{k+i} counts the tokens before i as output, which position_rows does not do.) Their law is
plain sampling's: the noises of distinct positions are independent and Gumbel-max is exact, so y_k
is a sample of p_k given y_<k.

Acceptance. A draft d fixed by the committed prefix is accepted with probability P(pick = d) = p(d),
the standard rejection rule's min(1, p(d) / q(d)) for a one-hot q on d, and on rejection the pick is
distributed as p without d, renormalised (the rule's residual max(0, p − q), normalised). The drafts
of every hylo proposer are fixed by the committed prefix: DFlash's are the target head's argmax,
DFlash2's the candidate selector's greedy path (an argmax of unary plus pairwise scores whatever the
request's temperature), MTP's each chained step's argmax. Were a draft sampled, d ~ q with noise of
its own, the emitted tokens would still be the y_k above (no draft enters them); a draft would be
accepted with probability Σ_x q(x) p(x), where the rejection rule reaches Σ_x min(p(x), q(x)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hylo.host_copy import to_device
from hylo.ops.acceptance import accepted_prefix
from hylo.sampling import RowsOfAStep, SampleRow, pick, target_distribution

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
    the first `accepted[v] + 1` entries of row v are its emitted tokens (the rest is unspecified);
    `committed [V]` (int32): accepted + 1, the block tokens that enter the caches; `anchors [V]`: the
    last emitted token, the next block's anchor. With logprobs asked for: `chosen [V, T]` the emitted
    tokens' logprobs and `top_ids`/`top_values` `[V, T, n]` the top-n of the raw distribution at each
    position."""

    accepted: torch.Tensor
    emitted: torch.Tensor
    committed: torch.Tensor
    anchors: torch.Tensor
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None


def accept(
    logits: torch.Tensor, drafts: torch.Tensor, blocks: VerifyBatch, positions: torch.Tensor
) -> Acceptance:
    """`logits [V, T, vocab]` (fp32) at the anchor and each draft of the V blocks of `blocks`,
    `drafts [V, T-1]` and `positions [V, T]` (int64: where in its sequence each position's pick goes,
    the token after the anchor or draft there) on the device. Position i's distribution is processed
    as if i tokens had already been generated (`VerifyBatch.position_rows`) and masked by
    `blocks.allowed` (structured outputs), so a draft the grammar refuses is never accepted. Nothing
    is read back to the host."""
    num_blocks, width, _ = logits.shape
    assert width <= MAX_BLOCK_TOKENS, f"a verify block holds at most {MAX_BLOCK_TOKENS} tokens, got {width}"
    counts = to_device(list(blocks.num_drafts), logits.device)
    if blocks.picks_argmax:
        picks = logits.argmax(-1)
    else:
        rows = blocks.position_rows(width)
        processed, probs = target_distribution(logits.flatten(0, 1), rows, blocks.allowed)
        picks = pick(processed, probs, rows, positions.flatten()).view(num_blocks, width)
    accepted, committed, anchors = accepted_prefix(picks, drafts, counts)
    return _with_logprobs(Acceptance(accepted, picks, committed, anchors), logits, blocks)


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
