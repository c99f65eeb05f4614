"""hylo: a serving engine for hybrid linear/sparse-attention MoE models.

`LLM`, `SamplingParams` and the output types are imported on first use, so kernels and models can
be imported (e.g. on a bare GPU image) without the serving dependencies.

Layers, top to bottom (a unit is a folder or a top-level module; an import goes down this list, never
up; each package's docstring says what it owns):

    cli
    server, llm, bench
    distributed
    engine, train
    speculative
    models
    layers
    parallel, forward_batch, kda_plan, structured
    memory, sampling
    ops, config, tokenizer, host_copy, sampling_noise
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "hylo.llm",
    "CompletionOutput": "hylo.llm",
    "RequestOutput": "hylo.llm",
    "SamplingParams": "hylo.sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hylo' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
