"""KDA (Kimi Delta Attention) ops: torch references and their Triton kernels behind one dispatcher.

The serving entry points (`prefill`, `decode`, `verify`, `commit`, `commit_steps`, `gated_norm`) take
CUDA tensors to the Triton kernels (`chunk.py`, `recurrent.py`, `rmsnorm.py`) and anything else to the torch
references (`reference.py`), with the same arguments. The chunked Triton prefill needs the safe gate
(-5 ≤ lower_bound < 0); other gates take the reference there. Verify and commit run as one block of T ≤ 16
tokens with the safe gate and step by step otherwise. Triton is imported on first CUDA use only.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.kda import reference
from hylo.ops.kda.reference import (
    CHUNK_TOKENS,
    ChunkSnapshots,
    KDAInputs,
    KDAParams,
    KDASlots,
    LowRank,
    OutputNorm,
    VerifyCache,
    causal_conv,
    gated_rms_norm,
    kda_chunked,
    kda_gate,
)

__all__ = [
    "CHUNK_TOKENS",
    "ChunkSnapshots",
    "KDAInputs",
    "KDAParams",
    "KDASlots",
    "LowRank",
    "OutputNorm",
    "VerifyCache",
    "causal_conv",
    "chunked_prefill_refusal",
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


def chunked_prefill_refusal(lower_bound: float | None) -> str | None:
    """Why the chunked Triton prefill cannot take a layer of this gate, or None."""
    if lower_bound is None or not -5.0 <= lower_bound < 0:
        return (
            f"the chunked Triton KDA prefill needs the safe gate (-5 <= lower_bound < 0), got {lower_bound}"
        )
    return None


def device_offsets_refusal(device: torch.device, lower_bound: float | None) -> str | None:
    """Why `prefill` with device offsets alone (`cu_seqlens_cpu` None) would read them back on
    `device`, None when it would not: on CUDA only the chunked Triton kernel takes them as they are
    (the reference pads on host lengths)."""
    return chunked_prefill_refusal(lower_bound) if device.type == "cuda" else None


def prefill(
    x: KDAInputs,
    params: KDAParams,
    slots: KDASlots,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int] | None,
    snapshots: ChunkSnapshots | None = None,
) -> torch.Tensor:
    """Packed varlen prefill (see `reference.prefill`): o `[N, H, d]`; windows and states updated.
    `cu_seqlens_cpu` None: a padded batch described by the device offsets alone
    (`device_offsets_refusal` says where that reads them back); `snapshots` inside the sequences."""
    args = (x, params, slots, cu_seqlens, cu_seqlens_cpu, snapshots)
    if use_kernel("kda.prefill", x.q, lambda: chunked_prefill_refusal(params.lower_bound)):
        from hylo.ops.kda import chunk

        return chunk.prefill(*args)
    return reference.prefill(*args)


def decode(x: KDAInputs, params: KDAParams, slots: KDASlots, norm: OutputNorm | None = None) -> torch.Tensor:
    """One token per sequence (see `reference.decode`): o `[B, H, d]`, gated-normalised by `norm` when
    given; windows and states updated. The gate's f and the norm's gate may come as `LowRank` factors,
    multiplied inside the launches that read them. Two launches on CUDA (`recurrent.decode`). Safe under
    CUDA-graph capture: fixed shapes, no host reads."""
    if use_kernel("kda.decode", x.q):
        from hylo.ops.kda import recurrent

        return recurrent.decode(x, params, slots, norm)
    return reference.decode(x, params, slots, norm)


def verify(
    x: KDAInputs, params: KDAParams, slots: KDASlots, step_states: torch.Tensor | None = None
) -> tuple[torch.Tensor, VerifyCache]:
    """T tokens per sequence (inputs `[B, T, ...]`) from the committed state, left untouched (see
    `reference.verify`): (o, the record `commit` takes)."""
    if use_kernel("kda.verify", x.q):
        from hylo.ops.kda import recurrent

        return recurrent.verify(x, params, slots, step_states)
    return reference.verify(x, params, slots, step_states)


def commit(cache: VerifyCache, params: KDAParams, slots: KDASlots, n_accepted: torch.Tensor) -> None:
    """Replay the first `n_accepted[b]` verified tokens onto the slot (see `reference.commit`)."""
    if use_kernel("kda.commit", slots.state_pool):
        from hylo.ops.kda import recurrent

        return recurrent.commit(cache, params, slots, n_accepted)
    return reference.commit(cache, params, slots, n_accepted)


def commit_steps(
    cache: VerifyCache, step_states: torch.Tensor, slots: KDASlots, n_accepted: torch.Tensor
) -> None:
    """Per-step-state commit: take the state saved after step `n_accepted[b]` (see `reference`)."""
    if use_kernel("kda.commit_steps", slots.state_pool):
        from hylo.ops.kda import recurrent

        return recurrent.commit_steps(cache, step_states, slots, n_accepted)
    return reference.commit_steps(cache, step_states, slots, n_accepted)


def gated_norm(x: torch.Tensor, norm: OutputNorm) -> torch.Tensor:
    """Sigmoid-gated RMSNorm per head of `x [N, H, d]` (see `reference.gated_rms_norm`)."""
    if use_kernel("kda.gated_norm", x):
        from hylo.ops.kda import rmsnorm

        return rmsnorm.gated_rms_norm(x, norm)
    return gated_rms_norm(x, reference.dense(norm.gate).reshape(x.shape), norm.weight, norm.eps)
