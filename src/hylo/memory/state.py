"""KDA state slots: each running request owns one slot holding every KDA layer's conv window and S."""

from __future__ import annotations

import torch

from hylo.config import ModelConfig


class StateCache:
    """Recurrent state of the KDA layers, indexed `[kda_layer, slot]`.

    Invariants: `conv[l, s]` holds the last `linear_conv_kernel_dim - 1` pre-conv q|k|v inputs of
    the sequence in slot `s` (zeros before its first token); `recurrent[l, s]` is the fp32 delta-rule
    state S (`[heads, d_k, d_v]`) after the sequence's last cached token. A fresh sequence's slot
    must be zeroed with `reset` before its first forward.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        n_kda = len(config.kda_layers)
        h, d = config.linear_num_heads, config.linear_head_dim
        conv_dim = 3 * h * d
        self.num_slots = num_slots
        self.conv = torch.zeros(
            n_kda, num_slots, config.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device
        )
        self.recurrent = torch.zeros(n_kda, num_slots, h, d, d, dtype=torch.float32, device=device)
        self.kda_index = {layer: i for i, layer in enumerate(config.kda_layers)}

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """State bytes of one request across all KDA layers: conv windows plus the fp32 S."""
        h, d, n_kda = config.linear_num_heads, config.linear_head_dim, len(config.kda_layers)
        conv = (config.linear_conv_kernel_dim - 1) * 3 * h * d * torch.finfo(dtype).bits // 8
        return n_kda * (conv + h * d * d * 4)

    def reset(self, slots: list[int]) -> None:
        for slot in slots:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
