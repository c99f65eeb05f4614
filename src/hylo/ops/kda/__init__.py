"""KDA (Kimi Delta Attention) ops. Only the torch reference exists so far."""

from hylo.ops.kda.reference import causal_conv, gated_rms_norm, kda_chunked, kda_gate

__all__ = ["causal_conv", "gated_rms_norm", "kda_chunked", "kda_gate"]
