"""KDA (Kimi Delta Attention) layer: the linear-attention layers of GLM-5.3-Flash."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
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
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, h * d, bias=False)
        self.v_proj = nn.Linear(hidden, h * d, bias=False)
        self.conv_weight = nn.Parameter(
            torch.empty(3 * h * d, config.linear_conv_kernel_dim, dtype=torch.float32)
        )
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(h * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, h * d, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(h * d, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens, heads = x.shape[0], (self.num_heads, self.head_dim)
        states = batch.states
        layer, slots = states.kda_index[self.layer_idx], batch.state_slots
        lengths = batch.pad_valid.sum(1)

        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv, window = kda_ops.causal_conv(
            batch.pad(qkv), states.conv[layer, slots], self.conv_weight, lengths
        )
        states.conv[layer, slots] = window
        q, k, v = (t.unflatten(-1, heads) for t in qkv.chunk(3, dim=-1))

        g = kda_ops.kda_gate(
            self.f_b_proj(self.f_a_proj(x)).unflatten(-1, heads), self.dt_bias, self.A_log, self.lower_bound
        )
        beta = torch.sigmoid(self.b_proj(x))
        o, final = kda_ops.kda_chunked(q, k, v, batch.pad(g), batch.pad(beta), states.recurrent[layer, slots])
        states.recurrent[layer, slots] = final

        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, heads)
        o = kda_ops.gated_rms_norm(batch.unpad(o), gate, self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(tokens, -1))
