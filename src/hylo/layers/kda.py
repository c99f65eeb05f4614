"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.layers.linear import Linear
from hylo.ops import kda as kda_ops


class KDAAttention(nn.Module):
    """q|k|v projections, one depthwise causal conv over the three, safe-gated delta rule, gated norm.

    `conv_weight [3·H·d, K]` is the checkpoint's q_conv1d, k_conv1d and v_conv1d stacked in that order.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        d, h, hidden = config.linear_head_dim, config.linear_num_heads, config.hidden_size
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, h, d
        self.lower_bound, self.eps = config.linear_lower_bound, config.rms_norm_eps
        self.q_proj = Linear(hidden, h * d)
        self.k_proj = Linear(hidden, h * d)
        self.v_proj = Linear(hidden, h * d)
        self.conv_weight = nn.Parameter(
            torch.empty(3 * h * d, config.linear_conv_kernel_dim, dtype=torch.float32)
        )
        self.f_a_proj = Linear(hidden, d)
        self.f_b_proj = Linear(d, h * d)
        self.dt_bias = nn.Parameter(torch.empty(h * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.b_proj = Linear(hidden, h)
        self.g_a_proj = Linear(hidden, d)
        self.g_b_proj = Linear(d, h * d)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = Linear(h * d, hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Packed tokens in, packed out. A step of single tokens takes the decode kernels, anything else the
        varlen chunked prefill; both read and advance the slots' conv windows and states in place."""
        tokens, heads = x.shape[0], (self.num_heads, self.head_dim)
        states = batch.states
        layer = states.kda_index[self.layer_idx]
        conv_pool, state_pool = states.conv[layer], states.recurrent[layer]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        f, b = self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)
        params = (self.conv_weight, self.dt_bias, self.A_log, conv_pool, state_pool, batch.state_slots)
        if max(batch.extend_lens) == 1:
            o = kda_ops.decode(q, k, v, f, b, *params, self.lower_bound)
        else:
            cu_cpu, cu = _cu_seqlens(batch)
            o = kda_ops.prefill(q, k, v, f, b, *params, cu, cu_cpu, self.lower_bound)

        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, heads)
        o = kda_ops.gated_norm(o, gate, self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(tokens, -1))


def _cu_seqlens(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """Token offsets of the batch's sequences (host list, int32 device copy), made once per batch."""
    cached = batch.__dict__.get("_kda_cu_seqlens")
    if cached is None:
        offsets = [0]
        for n in batch.extend_lens:
            offsets.append(offsets[-1] + n)
        device_copy = torch.tensor(offsets, dtype=torch.int32).to(batch.state_slots.device, non_blocking=True)
        cached = batch.__dict__["_kda_cu_seqlens"] = (offsets, device_copy)
    return cached
