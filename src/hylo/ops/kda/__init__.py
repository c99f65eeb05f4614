"""KDA (Kimi Delta Attention) ops: torch references and their Triton kernels behind one dispatcher.

The serving entry points (`prefill`, `decode`, `verify`, `commit`, `commit_steps`, `gated_norm`) take
CUDA tensors to the Triton kernels (`chunk.py`, `recurrent.py`, `rmsnorm.py`) and anything else to the torch
references (`reference.py`), with the same arguments. The chunked Triton prefill needs the safe gate
(-5 ≤ lower_bound < 0); other gates take the reference there. Verify and commit run as one block of T ≤ 16
tokens with the safe gate and step by step otherwise. Triton is imported on first CUDA use only.
"""

from __future__ import annotations

import torch

from hylo.ops.kda import reference
from hylo.ops.kda.reference import (
    CHUNK_TOKENS,
    ChunkSnapshots,
    VerifyCache,
    causal_conv,
    gated_rms_norm,
    kda_chunked,
    kda_gate,
)

__all__ = [
    "CHUNK_TOKENS",
    "ChunkSnapshots",
    "VerifyCache",
    "causal_conv",
    "commit",
    "commit_steps",
    "decode",
    "device_offsets_refusal",
    "gated_norm",
    "gated_rms_norm",
    "kda_chunked",
    "kda_gate",
    "prefill",
    "verify",
]


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def _chunked(device: torch.device, lower_bound: float | None) -> bool:
    return device.type == "cuda" and lower_bound is not None and -5.0 <= lower_bound < 0


def device_offsets_refusal(device: torch.device, lower_bound: float | None) -> str | None:
    """Why `prefill` with device offsets alone (`cu_seqlens_cpu` None) would read them back on
    `device`, None when it would not: on CUDA only the chunked Triton kernel takes them as they are
    (the reference pads on host lengths)."""
    if device.type == "cuda" and not _chunked(device, lower_bound):
        return (
            f"the chunked Triton KDA prefill needs the safe gate (-5 <= lower_bound < 0), got {lower_bound}"
        )
    return None


def prefill(
    q,
    k,
    v,
    f,
    b,
    conv_weight,
    dt_bias,
    a_log,
    conv_pool,
    state_pool,
    slot_ids,
    cu_seqlens,
    cu_seqlens_cpu,
    lower_bound,
    snapshots: ChunkSnapshots | None = None,
):
    """Packed varlen prefill (see `reference.prefill`): o `[N, H, d]`; windows and states updated.
    `cu_seqlens_cpu` None: a padded batch described by the device offsets alone
    (`device_offsets_refusal` says where that reads them back); `snapshots` inside the sequences."""
    args = (
        q,
        k,
        v,
        f,
        b,
        conv_weight,
        dt_bias,
        a_log,
        conv_pool,
        state_pool,
        slot_ids,
        cu_seqlens,
        cu_seqlens_cpu,
        lower_bound,
    )
    if _chunked(q.device, lower_bound):
        from hylo.ops.kda import chunk

        return chunk.prefill(*args, snapshots=snapshots)
    return reference.prefill(*args, snapshots)


def decode(q, k, v, f, b, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, lower_bound):
    """One token per sequence (see `reference.decode`): o `[B, H, d]`; windows and states updated."""
    args = (q, k, v, f, b, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, lower_bound)
    if _triton(q):
        from hylo.ops.kda import recurrent

        return recurrent.decode(*args)
    return reference.decode(*args)


def verify(
    q, k, v, f, b, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, lower_bound, step_states=None
):
    """T tokens per sequence from the committed state, left untouched (see `reference.verify`)."""
    args = (q, k, v, f, b, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, lower_bound)
    if _triton(q):
        from hylo.ops.kda import recurrent

        return recurrent.verify(*args, step_states=step_states)
    return reference.verify(*args, step_states=step_states)


def commit(cache, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, n_accepted, lower_bound):
    """Replay the first `n_accepted[b]` verified tokens onto the slot (see `reference.commit`)."""
    args = (cache, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, n_accepted, lower_bound)
    if _triton(state_pool):
        from hylo.ops.kda import recurrent

        return recurrent.commit(*args)
    return reference.commit(*args)


def commit_steps(cache, step_states, conv_pool, state_pool, slot_ids, n_accepted):
    """Per-step-state commit: take the state saved after step `n_accepted[b]` (see `reference`)."""
    args = (cache, step_states, conv_pool, state_pool, slot_ids, n_accepted)
    if _triton(state_pool):
        from hylo.ops.kda import recurrent

        return recurrent.commit_steps(*args)
    return reference.commit_steps(*args)


def gated_norm(x, gate, weight, eps):
    """Sigmoid-gated RMSNorm per head (see `reference.gated_rms_norm`)."""
    if _triton(x):
        from hylo.ops.kda import rmsnorm

        return rmsnorm.gated_rms_norm(x, gate, weight, eps)
    return gated_rms_norm(x, gate, weight, eps)
