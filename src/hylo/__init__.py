"""hylo: a serving engine for hybrid linear/sparse-attention MoE models."""

from hylo.llm import LLM, CompletionOutput, RequestOutput
from hylo.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
