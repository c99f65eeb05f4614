"""The KDA step family (`ops/kda/recurrent.py`, `rmsnorm.py`): decode with low-rank FP8 and dense gates at
64 and 8 heads, B = 1, 2 and 8; block and sequential verify, their commits and window steps."""

from __future__ import annotations

import torch
from code_size import HEAD_DIM, kda_operands

from hylo.ops.kda import recurrent, rmsnorm
from hylo.ops.kda.reference import KDAParams

MODULES = (recurrent, rmsnorm)


def verify_commit(batch: int, heads: int, t: int, step_states: bool) -> None:
    x, params, slots, _ = kda_operands(batch, heads, t, low_rank=False)
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
    x, params, slots, _ = kda_operands(batch, heads, t, low_rank=False)
    params = KDAParams(params.conv_weight, params.dt_bias, params.a_log, None)
    _, cache = recurrent.verify(x, params, slots)
    recurrent.commit(cache, params, slots, torch.ones(batch, dtype=torch.int32))


CASES = {
    "decode_lr_b1_h64": lambda: recurrent.decode(*kda_operands(1, 64)),
    "decode_lr_b8_h64": lambda: recurrent.decode(*kda_operands(8, 64)),
    "decode_lr_b1_h8": lambda: recurrent.decode(*kda_operands(1, 8)),
    "decode_dense_b8_h64": lambda: recurrent.decode(*kda_operands(8, 64, low_rank=False)),
    "decode_dense_nonorm_b2_h8": lambda: recurrent.decode(*kda_operands(2, 8, low_rank=False)[:3]),
    "verify_block_b1_t8": lambda: verify_commit(1, 64, 8, False),
    "verify_block_b8_t4": lambda: verify_commit(8, 8, 4, False),
    "verify_steps_b2_t4": lambda: verify_commit(2, 8, 4, True),
    "verify_seq_b2_t5": lambda: sequential(2, 8, 5),
}
