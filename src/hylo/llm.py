"""Offline API: `LLM(model=...).generate(...)` and `.chat(...)`, vLLM style."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from hylo.config import EngineConfig
from hylo.distributed.launch import start
from hylo.engine.engine import Engine
from hylo.engine.request import Metrics, Request
from hylo.sampling import SamplingParams
from hylo.speculative.proposer import Proposer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    """The completions of one prompt. `.text`, `.token_ids`, `.logprobs` and `.finish_reason` are
    those of the first completion (the only one unless `n > 1`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: Metrics
    # with `prompt_logprobs`: one entry per prompt position, None for position 0 (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """`LLM(model=PATH, device=..., dtype=..., **engine_args)`; engine args are the `hylo` CLI flags
    in snake_case (`chunked_prefill_size`, `max_running_requests`, `page_size`, ...)."""

    def __init__(
        self,
        model: str | None = None,
        proposer: Proposer | None = None,
        target=None,
        decode_graphs: bool | None = None,
        **engine_args: Any,
    ):
        """`proposer` plugs in a custom speculative proposer (instead of `speculative_algorithm`);
        `target` serves an already loaded model of `model` (another `LLM`'s `engine.model`);
        `decode_graphs` as `Engine` takes it (fixed-shape decode and verify steps on the CPU, for tests)."""
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = Engine(config, proposer, decode_graphs, target=target, ranks=start(config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Give back the engine's device memory (caches, graphs, proposer, and the model unless
        another `LLM` serves it as `target`) and stop its other ranks; `generate` raises afterwards.
        `with LLM(...) as llm:` closes it on leaving."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str] | str | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. Every prompt is validated before any work starts."""
        token_lists = self._encode(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params, len(token_lists))
        checked = []
        for i, (ids, p) in enumerate(zip(token_lists, params, strict=True)):
            try:
                checked.append(self.engine.validate_prompt(ids, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        groups = [
            self.engine.add_request(f"gen-{next(self._ids)}", prompt, p)
            for prompt, p in zip(checked, params, strict=True)
        ]
        with tqdm(total=sum(map(len, groups)), desc="Generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(out.finished for out in self.engine.step()))
        return [_request_output(group) for group in groups]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then `generate`."""
        if self.tokenizer is None:
            raise ValueError("chat: this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(list(c), **template_kwargs), add_special_tokens=False
            )
            for c in conversations
        ]
        return self.generate(sampling_params=sampling_params, prompt_token_ids=prompts, use_tqdm=use_tqdm)

    def _encode(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("generate: give exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(p) for p in prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if self.tokenizer is None:
            raise ValueError("prompts: this model has no tokenizer; pass prompt_token_ids")
        return [self.tokenizer.encode(p) for p in prompts]


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return list(params)


def _request_output(group: list[Request]) -> RequestOutput:
    first = group[0]
    outputs = [
        CompletionOutput(
            i,
            r.text,
            list(r.output_ids),
            list(r.logprobs) if r.params.logprobs is not None else None,
            r.finish_reason,
        )
        for i, r in enumerate(group)
    ]
    return RequestOutput(
        first.request_id.rsplit("-", 1)[0] if len(group) > 1 else first.request_id,
        list(first.prompt_ids),
        outputs,
        first.metrics,
        [None, *first.prompt_logprobs] if first.params.prompt_logprobs is not None else None,
    )
