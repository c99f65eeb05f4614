"""Closing an `LLM` gives back everything its engine holds (issue 47): no tensor the engine allocated
stays reachable once `close()` returns, while the `LLM` object itself still exists; a model another
`LLM` serves as `target` stays with it. The GPU side (allocated bytes back to their level before the
engines) is `test_llm_close_cuda.py`."""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.models.demo import DEMO_DIR

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "The quick brown fox jumps", "Hello"]  # a prefix-cache hit among them


def reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through hylo objects, torch modules, dataclasses and
    containers (not through functions, classes or modules: what a process shares)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = deque([root])
    while todo:
        obj = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            todo.extend(obj)
        elif isinstance(obj, torch.nn.Module) or dataclasses.is_dataclass(obj) or _is_hylo(obj):
            todo.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for name in getattr(type(obj), "__slots__", ()):
                todo.append(getattr(obj, name, None))
    return list(found.values())


def _is_hylo(obj: object) -> bool:
    return not isinstance(obj, type) and type(obj).__module__.startswith("hylo.")


def test_close_releases_every_tensor_the_engine_held():
    """A speculative (MTP) engine with fixed-shape decode batches (the CPU's stand-in for CUDA graphs:
    their static batches), a prefix cache and finished requests: after `close()` none of its weights,
    caches, proposer rows or static batches is reachable, without a garbage collection by the caller."""
    llm = LLM(
        str(DEMO_DIR), device="cpu", page_size=16, max_memory_gb=0.25, max_running_requests=4,
        cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=64, decode_graphs=True,
        speculative_algorithm="MTP", speculative_num_steps=2,
    )  # fmt: skip
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = llm.engine
    held = reachable_tensors(engine)
    ids = {id(t) for t in held}
    # what the walk must find: the model's weights, the token caches, the proposer's and the graphs'
    assert all(id(p) in ids for p in engine.model.parameters())
    assert id(engine.caches.tokens.index_key) in ids and id(engine.proposer.drafts) in ids
    assert engine.runner.graphs is not None and id(engine.runner.graphs.bank.step_inputs[1]) in ids
    refs = [weakref.ref(t) for t in held]
    del held, ids, engine

    llm.close()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [tuple(t.shape) for t in alive[:10]]
    assert [len(o.token_ids) for o in outs] == [GREEDY.max_tokens] * len(PROMPTS)  # outputs are the caller's
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.close()  # a second close does nothing


def test_close_keeps_a_model_another_llm_serves(shallow_model_dir):
    """Two `LLM`s over one loaded model (`target`): closing the first (`with` closes it on leaving)
    frees its caches but not the weights the second serves, which generates as before. (The 3-layer
    cut of the random test model, conftest `shallow_model_dir`: what is kept does not depend on the
    depth.)"""
    path = str(shallow_model_dir)
    with LLM(path, device="cpu", page_size=16, max_memory_gb=0.1) as first:
        second = LLM(path, device="cpu", page_size=16, max_memory_gb=0.1, target=first.engine.model)
        expected = [o.token_ids for o in first.generate(PROMPTS, GREEDY, use_tqdm=False)]
        caches = [weakref.ref(t) for t in reachable_tensors(first.engine.caches)]
        weights = [weakref.ref(p) for p in first.engine.model.parameters()]
    assert first.engine.closed and all(r() is None for r in caches)
    assert all(r() is not None for r in weights)
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    second.close()
    assert all(r() is None for r in weights)
