"""MoE ops. Only the torch reference exists so far."""

from hylo.ops.moe.reference import experts, route, swiglu_clamp

__all__ = ["experts", "route", "swiglu_clamp"]
