"""hylo: a serving engine for hybrid linear/sparse-attention MoE models."""
