"""Sampling parameters (vLLM conventions), a step's sampling batch and the batched sampler.

The sampler reads batch data only (`SamplingBatch`: parameters, seeds, banned ids, penalty history,
grammar masks), never a request: the engine builds the batch once per step
(`hylo.engine.sampling_batch`), and `speculative.verify.accept` reads the same rows block by block.

Seeded picks (`pick`): a sampled row's token is the Gumbel-max of its processed distribution p with
the noise of its (seed, position) (`hylo.sampling_noise`): argmax_t log p(t) + G(t), G(t) = -log E(t)
standard Gumbel, E(t) Exp(1); computed as argmax_t p(t) / E(t), the same argmax (an exponential
race: P(argmax = t) = p(t) exactly). Every request has a seed (its own, or one the engine drew at its
arrival) and the noise of an output position is a function of (seed, position) alone, so the token a
request picks at a position depends on p and nothing else: not on its batch, not on how many picks
came before, not on whether a plain step or a verify step made it (`speculative.verify`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hylo.host_copy import to_device
from hylo.sampling_noise import as_int64, exponential_noise

# Below this temperature sampling is greedy (vLLM's threshold): dividing logits by a tinier one
# overflows to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5
# A seed is any integer in [-2**63, 2**64) (the noise reads it mod 2**64); sequence i uses seed + i.
SEED_MIN, SEED_END = -(2**63), 2**64
MAX_N = 128
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 32, 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_CONSTRAINT_LENGTH = 65536  # characters of a JSON schema, regex or EBNF grammar
CONSTRAINTS = ("json_schema", "regex", "ebnf")


class SamplingParams(BaseModel):
    """How to pick each generated token and when to stop. Invalid values raise a `ValueError`
    (pydantic's `ValidationError`) naming the field; so does an unknown field."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=MAX_N, description="completions per prompt")
    temperature: float = Field(1.0, ge=0, description=f"0 (or below {GREEDY_BELOW}) is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(
        None,
        ge=SEED_MIN,
        lt=SEED_END,
        description="per-request seed: same seed, same output, whatever the batch",
    )
    max_tokens: int = Field(16, ge=0, description="0: score the prompt only (needs prompt_logprobs)")
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description="stop strings (not part of the output text)",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS
    )
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logprobs: int | None = Field(None, ge=0, le=20, description="top-n logprobs per generated token")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="top-n logprobs per prompt position (its own token's always)"
    )
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS, description="token id -> added to its logit"
    )
    # structured outputs (SGLang's names), at most one: the output matches it (`hylo.structured`)
    json_schema: str | None = Field(None, max_length=MAX_CONSTRAINT_LENGTH, description="a JSON schema")
    regex: str | None = Field(None, min_length=1, max_length=MAX_CONSTRAINT_LENGTH)
    ebnf: str | None = Field(None, min_length=1, max_length=MAX_CONSTRAINT_LENGTH, description="GBNF grammar")

    @field_validator("json_schema")
    @classmethod
    def _schema_is_json(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"must be JSON: {exc}") from exc
            if not isinstance(schema, dict | bool):
                raise ValueError("must be a JSON schema (an object or a boolean)")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: at most one constraint per request")
        return self

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, text) of the structured-output constraint, if any."""
        return next(
            ((name, getattr(self, name)) for name in CONSTRAINTS if getattr(self, name) is not None), None
        )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else ([] if value is None else value)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_LENGTH for s in value):
            raise ValueError(f"stop strings must be at most {MAX_STOP_LENGTH} characters")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or positive")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @model_validator(mode="after")
    def _zero_tokens_score(self) -> SamplingParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 generates nothing: it scores the prompt, with prompt_logprobs set")
        return self

    @model_validator(mode="after")
    def _seeds_in_range(self) -> SamplingParams:
        if self.seed is not None and self.seed + self.n > SEED_END:
            raise ValueError(
                f"seed + n - 1 ({self.seed + self.n - 1}) must be below 2**64 (sequence i uses seed + i)"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def raw_argmax(self) -> bool:
        """Greedy over the model's own logits: nothing (penalties, logit bias) changes them first, so
        the pick is their argmax alone (with no `min_tokens` ban in force, which the caller checks)."""
        return self.greedy and not self.penalized and not self.logit_bias and self.constraint is None


@dataclass(frozen=True)
class SampleRow:
    """One row of a sampling batch: the request's parameters and what it has seen so far."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int  # the request's sampling seed (its own, or drawn at its arrival): its picks' noise
    banned_ids: Sequence[int]  # eos/stop ids masked while min_tokens is not reached
    # the output token after `output_ids` that is still in flight (`[1]` long, on the device; an
    # overlapped step's), counted in the penalties like the others; None when there is none
    unread: torch.Tensor | None = None


class RowsOfAStep:
    """What a step's sampling rows say as a whole, for a batch with `rows` (`SampleRow`s) and an
    `allowed` grammar mask (None: no row constrained): `SamplingBatch` and the verify batch."""

    rows: Sequence[SampleRow]
    allowed: torch.Tensor | None

    @property
    def picks_argmax(self) -> bool:
        """Every row picks the argmax of the model's own logits: no grammar, no processing, no ban."""
        return picks_argmax(self.rows, self.allowed)

    @property
    def max_logprobs(self) -> int | None:
        """The most top logprobs a row asks for; None when no row asks for logprobs."""
        return max_logprobs(self.rows)


@dataclass(frozen=True)
class SamplingBatch(RowsOfAStep):
    """What `sample` reads of one step's sampling rows (vLLM's `SamplingMetadata`): row i of the batch
    picks from row i of the logits. Built once per step from the scheduled requests
    (`hylo.engine.sampling_batch`); holds values and device tensors only, so nothing below the engine
    sees a request.

    Invariants: `allowed` is None (no row constrained) or `[len(rows), vocab]` bool on the logits'
    device, a row without a grammar allowing everything; a row's `unread` token is counted in its
    penalties only (its bans are already decided on the host: `SampleRow.banned_ids`)."""

    rows: Sequence[SampleRow]
    allowed: torch.Tensor | None = None


def picks_argmax(rows: Sequence[SampleRow], allowed: torch.Tensor | None) -> bool:
    """Whether each of `rows` picks the raw argmax: no mask, no logit processing, no banned id."""
    return allowed is None and all(r.params.raw_argmax and not r.banned_ids for r in rows)


def max_logprobs(rows: Sequence[SampleRow]) -> int | None:
    """The most top logprobs one of `rows` asks for (0 is an ask: the picked token's own alone)."""
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    return max(wanted) if wanted else None


@dataclass
class Sampled:
    """Device results of one sampling batch: `tokens [B]`, and where any row asks for logprobs the
    sampled tokens' own (`chosen [B]`) and the top-n of the raw distribution (`top_ids`/`top_values`
    `[B, n]`, n the largest asked for)."""

    tokens: torch.Tensor
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None


def sample(logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor) -> Sampled:
    """Next token per row of `logits [B, V]` (fp32), one per row of `batch`, and logprobs where asked;
    nothing is read back. `positions [B]` (int64, on the logits' device): where in its sequence each
    row's pick goes, the counter of its noise (`pick`).

    Logprobs are of the raw model distribution (vLLM's default), the sampled token always included.
    """
    raw, rows, allowed = logits, batch.rows, batch.allowed
    if batch.picks_argmax:
        sampled = logits.argmax(-1)
    else:
        sampled = pick(*target_distribution(logits, rows, allowed), rows, positions)
    top_n = batch.max_logprobs
    if top_n is None:
        return Sampled(sampled)
    logprobs = torch.log_softmax(raw, dim=-1)
    top = logprobs.topk(top_n, dim=-1)
    return Sampled(sampled, logprobs.gather(1, sampled[:, None])[:, 0], top.indices, top.values)


# The noise's int64 temporaries are 8 bytes per (row, token): a verify step of 64 blocks of 16 rows at
# a 154,880-token vocabulary would hold ~1.3 GB in each, outside the memory plan. Rows go through in
# chunks whose temporaries stay within this (54 rows at that vocabulary: one chunk for decode steps).
NOISE_CHUNK_BYTES = 64 << 20


def _noisy_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """argmax of probs / E row by row, E the noise of (seeds[i], positions[i]), in chunks of rows."""
    rows = max(1, NOISE_CHUNK_BYTES // (8 * probs.shape[1]))
    chunks = zip(probs.split(rows), seeds.split(rows), positions.split(rows), strict=True)
    picks = [(p / exponential_noise(s, q, p.shape[1])).argmax(-1) for p, s, q in chunks]
    return picks[0] if len(picks) == 1 else torch.cat(picks)


def pick(
    processed: torch.Tensor, probs: torch.Tensor, rows: Sequence[SampleRow], positions: torch.Tensor
) -> torch.Tensor:
    """Each row's token from its processed logits and distribution (`target_distribution`): a greedy
    row's argmax of `processed`, a sampled row's Gumbel-max of `probs` with the noise of (its seed,
    `positions[i]`), an exact sample of it (see the module). A batch of greedy rows draws no noise."""
    device = processed.device
    if all(r.params.greedy for r in rows):
        return processed.argmax(-1)
    seeds = to_device([as_int64(r.seed) for r in rows], device, torch.long)
    noisy = _noisy_argmax(probs, seeds, positions)
    if not any(r.params.greedy for r in rows):
        return noisy
    greedy = to_device([r.params.greedy for r in rows], device)
    return torch.where(greedy, processed.argmax(-1), noisy)


def logprob_entry(
    token: int, chosen: float, top_ids: Sequence[int], top_values: Sequence[float], n: int
) -> dict[int, float]:
    """One position's top-n logprobs (host values), the picked token itself always included."""
    entry = dict(zip(top_ids[:n], top_values[:n], strict=True))
    entry[token] = chosen
    return entry


def target_distribution(
    logits: torch.Tensor, rows: Sequence[SampleRow], allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The processed logits (penalties, logit bias, banned ids, then tokens outside `allowed [B, V]`)
    and the distribution each row samples from (temperature, then top-k / top-p / min-p). Greedy rows
    sample the argmax of the logits. The constraint wins: a row whose processing left none of its
    allowed tokens possible (a huge penalty, or a grammar that can only end while `min_tokens` bans
    its end) picks uniformly among them."""
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row.params.penalized:
            _apply_penalties(logits[i], row)
        if row.params.logit_bias:
            bias = row.params.logit_bias
            ids = to_device(list(bias), logits.device, torch.long)
            logits[i, ids] += to_device(list(bias.values()), logits.device, logits.dtype)
        if row.banned_ids:
            logits[i, to_device(list(row.banned_ids), logits.device, torch.long)] = float("-inf")
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(logits).all(-1, keepdim=True)
        logits = torch.where(dead & allowed, 0.0, logits)
    # a temperature past the dtype's range would be inf there, and -inf / inf is NaN
    largest = torch.finfo(logits.dtype).max
    temps = [1.0 if r.params.greedy else min(r.params.temperature, largest) for r in rows]
    # softmax does not see a shift: with each row's largest logit at 0 before the temperature divides,
    # finite logits near the dtype's lowest (a huge penalty on a constrained row's only allowed tokens)
    # are not divided to -inf (a row of -inf alone is NaN)
    shifted = logits - logits.amax(-1, keepdim=True).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    probs = torch.softmax(shifted / to_device(temps, logits.device, logits.dtype)[:, None], dim=-1)
    return logits, _truncate(probs, rows)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """vLLM semantics: repetition over prompt + output, frequency/presence over the output (the
    token in flight included: `SampleRow.unread`)."""
    p = row.params
    device = logits.device
    # a penalty outside the dtype's range would be inf or 0 there: 0 · inf and 0 / 0 are NaN
    penalty = min(max(p.repetition_penalty, torch.finfo(logits.dtype).tiny), torch.finfo(logits.dtype).max)
    if penalty != 1:  # a mask of the seen ids counts the token in flight once, seen before or not
        seen = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
        seen[to_device(sorted({*row.prompt_ids, *row.output_ids}), device, torch.long)] = True
        if row.unread is not None:
            seen[row.unread] = True
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if (p.frequency_penalty or p.presence_penalty) and (row.output_ids or row.unread is not None):
        ids = to_device(list(row.output_ids), device, torch.long)
        if row.unread is not None:
            ids = torch.cat([ids, row.unread])
        counts = torch.bincount(ids, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _truncate(probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """top-k, then top-p, then min-p, each only where a row asks for it (decided on the host)."""
    vocab, device = probs.shape[1], probs.device
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    ps = [r.params.top_p for r in rows]
    if any(k < vocab for k in ks) or any(p < 1 for p in ps):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        top_k, top_p = to_device(ks, device), to_device(ps, device, probs.dtype)
        # the most likely token always stays: a top_p below fp32's smallest value rounds to 0 here
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = (rank >= top_k[:, None]) | ((mass_before >= top_p[:, None]) & (rank > 0))
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0))
    if any(r.params.min_p > 0 for r in rows):
        min_p = to_device([r.params.min_p for r in rows], device, probs.dtype)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0)
    return probs
