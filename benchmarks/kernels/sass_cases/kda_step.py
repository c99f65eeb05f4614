"""The KDA step family (`ops/kda/recurrent.py`, `rmsnorm.py`): decode with low-rank FP8 and dense gates at
64 and 8 heads, B = 1, 2 and 8; block and sequential verify, their commits and window steps."""

from __future__ import annotations

import torch
from code_size import HEAD_DIM, HIDDEN

from hylo.ops.kda import recurrent, rmsnorm
from hylo.ops.kda.reference import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm

BF16 = torch.bfloat16
MODULES = (recurrent, rmsnorm)


def setup(batch: int, heads: int, t: int = 1, low_rank: bool = True):
    """Zero operands of a step: `t` tokens a sequence (decode's `[B, H·d]` rows at t = 1), low-rank FP8
    gate factors and β from the layer input, or dense gates."""
    hd = heads * HEAD_DIM

    def factor() -> LowRank:
        weight = torch.zeros(hd, HEAD_DIM, dtype=torch.float8_e4m3fn)
        return LowRank(torch.zeros(batch, HEAD_DIM, dtype=BF16), weight, torch.ones(hd // 128, 1))

    lead = (batch,) if t == 1 else (batch, t)
    q, k, v = torch.zeros(*lead, 3 * hd, dtype=BF16).split(hd, dim=-1)
    if low_rank:
        f, b = (
            factor(),
            LowRank(torch.zeros(batch, HIDDEN, dtype=BF16), torch.zeros(heads, HIDDEN, dtype=BF16)),
        )
    else:
        f, b = torch.zeros(*lead, hd, dtype=BF16), torch.zeros(*lead, heads, dtype=BF16)
    params = KDAParams(torch.zeros(3 * hd, 4), torch.zeros(hd), torch.zeros(heads), -5.0)
    slots = KDASlots(
        torch.zeros(batch + 1, 3, 3 * hd, dtype=BF16),
        torch.zeros(batch + 1, heads, HEAD_DIM, HEAD_DIM),
        torch.arange(batch, dtype=torch.int32),
    )
    gate = factor() if low_rank else torch.zeros(batch, hd, dtype=BF16)
    return KDAInputs(q, k, v, f, b), params, slots, OutputNorm(gate, torch.ones(HEAD_DIM, dtype=BF16), 1e-5)


def verify_commit(batch: int, heads: int, t: int, step_states: bool) -> None:
    x, params, slots, _ = setup(batch, heads, t, low_rank=False)
    accepted = torch.ones(batch, dtype=torch.int32)
    if step_states:
        states = torch.zeros(batch, t, heads, HEAD_DIM, HEAD_DIM)
        _, cache = recurrent.verify(x, params, slots, step_states=states)
        recurrent.commit_steps(cache, states, slots, accepted)
    else:
        _, cache = recurrent.verify(x, params, slots)
        recurrent.commit(cache, params, slots, accepted)


def sequential(batch: int, heads: int, t: int) -> None:
    """Verify and commit without the safe gate: the sequential kernel's replay."""
    x, params, slots, _ = setup(batch, heads, t, low_rank=False)
    params = KDAParams(params.conv_weight, params.dt_bias, params.a_log, None)
    _, cache = recurrent.verify(x, params, slots)
    recurrent.commit(cache, params, slots, torch.ones(batch, dtype=torch.int32))


CASES = {
    "decode_lr_b1_h64": lambda: recurrent.decode(*setup(1, 64)),
    "decode_lr_b8_h64": lambda: recurrent.decode(*setup(8, 64)),
    "decode_lr_b1_h8": lambda: recurrent.decode(*setup(1, 8)),
    "decode_dense_b8_h64": lambda: recurrent.decode(*setup(8, 64, low_rank=False)),
    "decode_dense_nonorm_b2_h8": lambda: recurrent.decode(*setup(2, 8, low_rank=False)[:3]),
    "verify_block_b1_t8": lambda: verify_commit(1, 64, 8, False),
    "verify_block_b8_t4": lambda: verify_commit(8, 8, 4, False),
    "verify_steps_b2_t4": lambda: verify_commit(2, 8, 4, True),
    "verify_seq_b2_t5": lambda: sequential(2, 8, 5),
}
