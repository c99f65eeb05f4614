"""Counter-based sampling noise: the Exp(1) noise of a (seed, position, token id) is a function of
those three integers alone, computed on the device with int64 tensor ops. No generator state
advances, so what a request draws at an output position depends on nothing else: not on the batch
it is in, not on how many steps (plain or verify, launched ahead or not) came before.

The bits are SplitMix64's output stream (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014): a Weyl sequence `state + k·γ` through its 64-bit finaliser. Each
(seed, position) row starts its own stream at a state hashed from both; token t takes element t + 1
of it. Two rows' streams overlap only if their states lie within a vocabulary of Weyl steps of each
other: probability about `rows · vocab / 2**64` for a whole workload, never in practice.

torch's int64 `*` and `+` wrap (two's complement), which is uint64 arithmetic on the same bits;
`>>` is arithmetic, so a logical shift masks the sign bits off. tests/test_sampling.py holds the
same function on Python integers, the truth this one is tested against.
"""

from __future__ import annotations

import torch

UINT64_MASK = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's Weyl increment (odd: the sequence has period 2**64)
MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
MIX_SHIFTS = (30, 27, 31)
# Uniforms on the grid (k + 0.5) / 2**23, k < 2**23: every value and 1 - value is exact in fp32, so
# u lies in [2**-24, 1 - 2**-24] and -log(u) in [6e-8, 16.7]: never 0 (a division by it) nor inf.
UNIFORM_BITS = 23


def as_int64(value: int) -> int:
    """The int64 with the bits of `value` mod 2**64 (a seed may be any integer in [-2**63, 2**64))."""
    value &= UINT64_MASK
    return value - 2**64 if value >= 2**63 else value


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of int64 `x`, as a new tensor."""
    x = x ^ _logical_shift(x, MIX_SHIFTS[0])
    x.mul_(as_int64(MIX_MULTIPLIERS[0]))
    x ^= _logical_shift(x, MIX_SHIFTS[1])
    x.mul_(as_int64(MIX_MULTIPLIERS[1]))
    x ^= _logical_shift(x, MIX_SHIFTS[2])
    return x


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise `[R, vocab]` (fp32) of rows with int64 `seeds [R]` (`as_int64` of the request's
    seed) and `positions [R]` (where in its sequence the row's pick goes), on their device: entry
    (r, t) is -log(u) for the uniform u of (seeds[r], positions[r], t), independent across entries
    (up to the hash's quality). Safe to use in a CUDA graph: fixed shapes, no host value read."""
    state = mix64(mix64(seeds + as_int64(GAMMA)) + positions * as_int64(GAMMA))
    steps = torch.arange(1, vocab + 1, device=seeds.device) * as_int64(GAMMA)
    bits = mix64(state[:, None] + steps[None, :])
    grid = _logical_shift(bits, 64 - UNIFORM_BITS).float()
    return grid.add_(0.5).mul_(2.0**-UNIFORM_BITS).log_().neg_()
