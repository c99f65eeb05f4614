"""Seeded sampling and acceptance against the reference distribution, at the op level (many rows in one
call: seconds): the counter-based noise against its integer reference and for uniformity, plain
sampling and draft acceptance against the distribution computed here from the logits (temperatures
0.5, 1 and 1.5 with top-k, top-p, min-p and penalties), the acceptance rate the drafts reach, and the
greedy prefix rule at padded blocks.

Statistics: each statistical assertion is a test at false-alarm rate ALPHA (chi-square p-value or a
two-sided normal z-bound), so a correct sampler fails one of the 28 of this file with probability
below 28 · ALPHA ≈ 3e-5 for a fresh choice of seeds (the seeds here are fixed: a run is repeatable).
"""

from __future__ import annotations

import math

import pytest
import torch

from hylo.ops.acceptance import accepted_prefix
from hylo.sampling import SampleRow, SamplingBatch, SamplingParams, sample
from hylo.sampling_noise import (
    GAMMA,
    MIX_MULTIPLIERS,
    MIX_SHIFTS,
    UINT64_MASK,
    UNIFORM_BITS,
    as_int64,
    exponential_noise,
    mix64,
)
from hylo.speculative.verify import VerifyBatch, accept

ALPHA = 1e-6
Z_BOUND = float(torch.special.ndtri(torch.tensor(1 - ALPHA / 2, dtype=torch.float64)))  # 4.89
VOCAB = 12
TEMPERATURES = (0.5, 1.0, 1.5)


def mix_reference(z: int) -> int:
    """SplitMix64's finaliser on Python integers (uint64 arithmetic written out)."""
    z &= UINT64_MASK
    for shift, multiplier in zip(MIX_SHIFTS[:2], MIX_MULTIPLIERS, strict=True):
        z = ((z ^ (z >> shift)) * multiplier) & UINT64_MASK
    return z ^ (z >> MIX_SHIFTS[2])


def uniform_reference(seed: int, position: int, token: int) -> float:
    state = mix_reference(mix_reference(seed + GAMMA) + position * GAMMA)
    bits = mix_reference(state + (token + 1) * GAMMA)
    return ((bits >> (64 - UNIFORM_BITS)) + 0.5) * 2.0**-UNIFORM_BITS


def test_noise_matches_its_integer_reference():
    """The int64 hash equals uint64 arithmetic bit for bit (wrapping products, logical shifts), and the
    noise is -log of the reference's uniform: the uniform is exact in fp32 (a 23-bit grid) and fp32's
    log is correct to an ulp, so within 2 ulps relative."""
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -0x0123456789ABCDEF, 12345]
    mixed = mix64(torch.tensor(values))
    assert mixed.tolist() == [as_int64(mix_reference(v)) for v in values]
    seeds = [0, 1, -(2**63), 2**64 - 1, 12345678901234567, -5]
    positions = [0, 7, 100000, 3, 2**40, 1]
    noise = exponential_noise(torch.tensor([as_int64(s) for s in seeds]), torch.tensor(positions), 300)
    expected = torch.tensor(
        [
            [-math.log(uniform_reference(s, p, t)) for t in range(300)]
            for s, p in zip(seeds, positions, strict=True)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(noise.double(), expected, rtol=2 * 2.0**-23, atol=0)


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of counts `observed` against `expected` counts (cells expected
    below 5 pooled into one, which is dropped when it expects nothing)."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    keep = expected >= 5
    pooled_e, pooled_o = expected[~keep].sum(), observed[~keep].sum()
    if pooled_e > 0:
        expected = torch.cat([expected[keep], pooled_e[None]])
        observed = torch.cat([observed[keep], pooled_o[None]])
    else:
        assert pooled_o == 0, "a count where the distribution has no mass"
        expected, observed = expected[keep], observed[keep]
    dof = len(expected) - 1
    if dof == 0:  # all the mass on one token, and every count there
        return 1.0
    chi2 = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), chi2 / 2))


def test_noise_is_uniform_and_independent_across_seeds_positions_and_tokens():
    """Uniforms of 512 (seed, position) rows × 2048 tokens in 64 bins; pairs of neighbours (seeds s
    and s + 1, as sequences of one request's n take; positions p and p + 1; tokens t and t + 1) in
    16 × 16 bins: chi-square at ALPHA each."""
    seeds = torch.arange(512) // 8 + 1000
    positions = torch.arange(512) % 8 + 40
    u = torch.exp(-exponential_noise(seeds, positions, 2048).double())
    expected = torch.full((64,), u.numel() / 64)
    assert chi_square_p_value(torch.histc(u, 64, 0, 1), expected) > ALPHA
    grid = u.view(64, 8, 2048)
    beside = {
        "seed": (grid[:-1], grid[1:]),
        "position": (grid[:, :-1], grid[:, 1:]),
        "token": (grid[..., :-1], grid[..., 1:]),
    }
    for name, (a, b) in beside.items():
        cells = (a * 16).long() * 16 + (b * 16).long()
        counts = torch.bincount(cells.flatten(), minlength=256)
        assert chi_square_p_value(counts, torch.full((256,), cells.numel() / 256)) > ALPHA, name


def reference_distribution(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The distribution a row samples from, written from vLLM's definitions one after the other in
    float64: repetition penalty over prompt + output, frequency and presence over the output, divide
    by the temperature, softmax, keep the top-k, keep the smallest most-likely set of mass >= top-p,
    drop tokens below min-p × the largest probability, renormalise."""
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    p = torch.softmax(x / params.temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if params.top_k > 0 and rank >= params.top_k:
            break
        # the test's logits keep clear of the cut by more than the sampler's fp32 cumulative sum can
        # err (a few roundings of 6e-8 over a dozen terms): it decides the cut the same way
        assert abs(mass - params.top_p) > 1e-5, "a top-p boundary within rounding"
        if mass >= params.top_p:
            break
        keep[t] = True
        mass += float(p[t])
    keep &= p >= params.min_p * p.max()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


CASES = {
    "top_p": {"top_p": 0.8},
    "top_k_min_p": {"top_k": 5, "min_p": 0.04},
    "penalties": {
        "repetition_penalty": 1.4,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "top_p": 0.95,
    },
}


def case_logits(seed: int, positions: int = 1) -> torch.Tensor:
    """Standard normal logits `[positions, VOCAB]`: at temperature 0.5 with the cases' truncation
    still 3 to 7 tokens possible, so every temperature has a distribution to test."""
    return torch.randn(positions, VOCAB, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("case", list(CASES))
def test_plain_sampling_follows_the_processed_distribution(temperature, case):
    """16384 rows (4096 with penalties, which the sampler applies row by row) of the same logits and
    history, each its own (seed, position), in one `sample` call: the picks' histogram against the
    reference distribution (chi-square at ALPHA)."""
    rows = 4096 if case == "penalties" else 16384
    params = SamplingParams(temperature=temperature, max_tokens=50, **CASES[case])
    prompt, output = [1, 4, 4, 7], [2, 7, 7, 9, 2, 7]
    logits = case_logits(3)[0]
    batch = SamplingBatch(
        [SampleRow(params, prompt, output, seed=r // 4, banned_ids=[]) for r in range(rows)]
    )
    positions = torch.arange(rows) % 4 + len(prompt) + len(output)
    picked = sample(logits.expand(rows, VOCAB).clone(), batch, positions).tokens
    expected = reference_distribution(logits, params, prompt, output)
    assert chi_square_p_value(torch.bincount(picked, minlength=VOCAB), expected * rows) > ALPHA
    # the same (seed, position) gives the same pick, whatever else is in the call
    again = sample(logits[None].clone(), SamplingBatch(batch.rows[5:6]), positions[5:6]).tokens
    assert again.item() == picked[5].item()


def oracle_drafts(probs: torch.Tensor, blocks: int, seed: int) -> torch.Tensor:
    """Drafts `[blocks, width]` (one past the drafts: the padding column) fixed before any noise: each
    the most likely token at its position half the time (an oracle right as often as that token's
    probability), a uniformly random token otherwise."""
    gen = torch.Generator().manual_seed(seed)
    width = probs.shape[0]
    oracle = torch.rand(blocks, width, generator=gen) < 0.5
    guess = torch.randint(0, VOCAB, (blocks, width), generator=gen)
    return torch.where(oracle, probs.argmax(-1)[None, :], guess)


def acceptance_moments(draft_probs: torch.Tensor, counts: torch.Tensor) -> tuple[float, float]:
    """Mean and variance of the total drafts accepted over blocks whose draft j is kept with
    probability `draft_probs[v, j]` independently, the first `counts[v]` of them real: per block
    A = Σ_j I_j with I_j = Π_{i<=j} B_i, so E[A] = Σ_j P_j and E[A²] = Σ_j P_j + 2 Σ_{j<k} P_k."""
    real = torch.arange(draft_probs.shape[1])[None, :] < counts[:, None]
    reach = torch.where(real, draft_probs, 0.0).cumprod(1)  # P_j: drafts 0..j all kept
    mean = reach.sum(1)
    second = mean + 2 * (reach * torch.arange(draft_probs.shape[1])[None, :]).sum(1)
    return float(mean.sum()), float((second - mean**2).sum())


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_acceptance_follows_the_processed_distribution_and_accepts_at_its_rate(temperature):
    """12288 verify blocks of 4 positions (top-k, top-p, min-p), with 0-3 real drafts each fixed before
    the noise (the oracle right half the time) and the padding past them as likely to match as a
    draft: at each position the emitted token, among the blocks that reach it, follows that
    position's processed distribution (chi-square at ALPHA); the drafts kept are a prefix of the real
    ones equal to the picks; the total kept matches Σ over blocks of the chance of each prefix
    (z-bound at ALPHA; a draft d is kept with probability p(d))."""
    blocks, width = 12288, 4
    params = SamplingParams(temperature=temperature, top_k=8, top_p=0.9, min_p=0.02, max_tokens=50)
    logits = case_logits(12, width)
    probs = torch.stack([reference_distribution(logits[i], params, [], []) for i in range(width)])
    padded = oracle_drafts(probs, blocks, seed=12)
    drafts = padded[:, :-1]
    counts = torch.randint(0, width, (blocks,), generator=torch.Generator().manual_seed(13))
    padded_drafts = torch.where(torch.arange(width - 1)[None, :] < counts[:, None], drafts, padded[:, -1:])
    rows = [SampleRow(params, [3], [], seed=v, banned_ids=[]) for v in range(blocks)]
    batch = VerifyBatch(rows, counts.tolist(), [0] * blocks)
    positions = 100 + torch.arange(width).expand(blocks, width)
    result = accept(logits.expand(blocks, width, VOCAB).clone(), padded_drafts, batch, positions)
    accepted, emitted = result.accepted, result.emitted

    steps = torch.arange(width - 1)[None, :]
    matches = (emitted[:, :-1] == drafts) & (steps < counts[:, None])
    assert torch.equal(accepted, matches.int().cumprod(1).sum(1))  # the longest matching real prefix
    for i in range(width):
        reached = accepted >= i
        observed = torch.bincount(emitted[reached, i], minlength=VOCAB)
        assert chi_square_p_value(observed, probs[i] * int(reached.sum())) > ALPHA, i
    draft_probs = probs[torch.arange(width - 1)[None, :], drafts].double()
    mean, variance = acceptance_moments(draft_probs, counts)
    kept = int(accepted.sum())
    assert abs(kept - mean) < Z_BOUND * math.sqrt(variance), (kept, mean, variance)


def test_greedy_prefix_stops_at_each_rows_real_drafts():
    """The kept drafts are the longest prefix equal to the target's picks among a row's real drafts
    only: padding past them is never kept, even where it equals the picks."""
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 9, 7], [5, 6, 7], [4, 6, 7]])
    counts = torch.tensor([3, 1, 3, 0, 2])
    accepted, committed, anchors = accepted_prefix(target, drafts, counts)
    assert accepted.tolist() == [3, 1, 1, 0, 0] and committed.tolist() == [4, 2, 2, 1, 1]
    assert anchors.tolist() == [8, 6, 6, 5, 5]  # the pick after the last kept draft


def test_picks_in_chunks_of_rows_are_the_picks_of_one_pass(monkeypatch):
    """The noise is drawn in chunks of rows to bound its temporaries; a row's pick does not depend on
    the chunk it falls in (each row's noise is a function of its own seed and position)."""
    from hylo import sampling

    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(37, 50, generator=gen), -1)
    seeds = torch.randint(-(2**62), 2**62, (37,), generator=gen)
    positions = torch.randint(0, 1000, (37,), generator=gen)
    whole = sampling._noisy_argmax(probs, seeds, positions)
    monkeypatch.setattr(sampling, "NOISE_CHUNK_BYTES", 8 * 50 * 5)  # chunks of 5 rows, the last of 2
    assert torch.equal(sampling._noisy_argmax(probs, seeds, positions), whole)


def test_allowed_tokens_near_the_lowest_logit_keep_their_probability():
    """A huge repetition penalty can leave a constrained row's only allowed tokens finite but near fp32's
    lowest value; a temperature below 1 then divided them to -inf (every logit -inf: NaN probabilities
    and token 0, a token the grammar forbids, found by test_structured on a 3-layer model). The row must
    put its mass on its allowed tokens: all of it on the larger of two whose logits lie ten fp32 steps
    (2e32) apart there."""
    from hylo.sampling import target_distribution

    lowest = torch.finfo(torch.float32).min
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    logits[0, 7], logits[0, 9] = lowest * 0.9, lowest * 0.9 + 2e32  # / 0.7: below fp32's lowest
    allowed = torch.zeros(2, 30, dtype=torch.bool)
    allowed[0, [7, 9]] = True
    allowed[1] = True
    rows = [SampleRow(SamplingParams(temperature=0.7), [], [], 0, []) for _ in range(2)]
    _, probs = target_distribution(logits, rows, allowed)
    assert not probs.isnan().any() and (probs[~allowed] == 0).all()
    assert probs[0, 9] == 1.0
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 0.7, -1))
