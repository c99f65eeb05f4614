"""MoE ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to the Triton routing kernel and grouped GEMMs (`routing`, `kernels`), everything
else to the reference. `experts` takes the experts' weights as one `ExpertWeights`: in x's dtype, or
e4m3 with per-[128, 128]-block fp32 `scale_inv`. `routed_experts` is route then experts in one call, so
that steps of a few tokens can take the three-launch path of `decode`.

The shared expert (`SharedExpert`, its own tensors) joins that path as one more pair of weight 1 per
token, computed by the same launches, where `shared_refusal` has nothing against it: on CUDA, a step
`decode.fits`, and the shared expert in the routed experts' format with at most a routed expert's
intermediate (one rank; experts split by tensor, both sliced alike; experts split by expert beside the
shared expert's tensor slice, narrower). Elsewhere (prefill-sized steps, the CPU) its caller computes it
apart and passes its output as `routed_experts`' addend.

Expert parallelism (`first_expert`): the expert ops take global expert ids and the global id of the
first expert their weights hold; a pair routed to an expert outside `[first_expert, first_expert + E)`
adds nothing and is never computed (no GEMM row, in the reference or the kernels). None: the ids
index the weights directly (one rank, or experts split by tensor).
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.moe import reference
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert, swiglu_clamp

__all__ = [
    "Choices",
    "ExpertWeights",
    "Routing",
    "SharedExpert",
    "experts",
    "route",
    "routed_experts",
    "shared_refusal",
    "swiglu_clamp",
]


def route(x: torch.Tensor, routing: Routing) -> Choices:
    """Sigmoid group-limited routing of x's tokens (expert ids `[T, k]`, fp32 weights `[T, k]`), as
    `reference.route`."""
    if use_kernel("moe.route", x):
        from hylo.ops.moe import routing as triton_routing  # the module; `routing` is the router here

        return triton_routing.route(x, routing)
    return reference.route(x, routing)


def experts(
    x: torch.Tensor, w: ExpertWeights, choices: Choices, limit: float, first_expert: int | None = None
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x_t) over the pairs of the weights' experts (`first_expert`:
    module docstring)."""
    if use_kernel("moe.experts", x):
        from hylo.ops.moe import kernels

        return kernels.experts(x, w, choices, limit, first_expert=first_expert)
    return reference.experts(x, w, choices, limit, first_expert)


def shared_refusal(x: torch.Tensor, top_k: int, w: ExpertWeights, shared: SharedExpert) -> str | None:
    """Why `routed_experts` cannot compute `shared` in the routed experts' launches for x's tokens at
    top-`top_k` (module docstring), or None: then it takes `shared=`, else the caller adds the shared
    expert's output itself (`addend`)."""

    reason = None

    def verify() -> str | None:
        from hylo.ops.moe import decode, kernels

        nonlocal reason
        if not decode.fits(x.shape[0], top_k):
            reason = (
                f"{x.shape[0]} tokens at top-{top_k} are more than the decode path's {decode.MAX_PAIRS} pairs"
            )
        else:
            reason = kernels.shared_refusal(w, shared)
        return reason

    if use_kernel("moe.shared_expert", x, verify, fallback="its caller, apart from the routed experts"):
        return None
    return reason or "not on a CUDA device"


def routed_experts(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    first_expert: int | None = None,
    addend: torch.Tensor | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """`experts(x, ExpertWeights(gate_up, down, scales), route(x, routing), limit, first_expert)`, plus
    `addend` (`[T, D]` in x's dtype: the shared expert's output) where given: FP8 with `scales` =
    (gate_up_scale_inv, down_scale_inv). Every token is routed over all of the router's experts; with
    `first_expert`, only the pairs of the weights' experts are computed. On CUDA, steps of at most
    `decode.MAX_PAIRS` (token, choice) pairs run as three launches (`decode.routed_experts`), with or
    without `first_expert`, the addend added in the last of them. `shared` (in place of `addend`, only
    where `shared_refusal` is None): the shared expert computed in those launches."""
    w = ExpertWeights(gate_up, down, scales)
    if shared is not None:
        refusal = shared_refusal(x, routing.top_k, w, shared)
        if refusal is not None:
            raise ValueError(f"routed_experts: the shared expert cannot join the routed launches: {refusal}")
    if use_kernel("moe.routed_experts", x):
        from hylo.ops.moe import decode

        if decode.fits(x.shape[0], routing.top_k):
            return decode.routed_experts(
                x, routing, w, limit, first_expert=first_expert, addend=addend, shared=shared
            )
    out = experts(x, w, route(x, routing), limit, first_expert)
    return out if addend is None else out + addend
