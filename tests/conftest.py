from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hf_reference import hf_model, tiny_text_config, write_hf_checkpoint

from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.models.loader import load_model

TRITON_LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"}


# The longest test files on the CPU, longest first: the sum of each file's test times in a `make test`
# run on the 2-core machine (RESULTS S29-5: rough). `make test` hands whole files to its two workers in
# collection order (--dist loadfile --no-loadscope-reorder; xdist's own reorder puts files with few
# tests last, so the one-test fuzz file ran alone at the end): these go first, and the short files
# after them even out the two workers' ends.
LONGEST_FILES_FIRST = (
    "test_server_fuzz.py",  # 78
    "test_server_robustness.py",  # 63
    "test_kda_kernels.py",  # 48
    "test_tensor_parallel_server.py",  # 47
    "test_overlap.py",  # 41
    "test_prefix_cache.py",  # 36
    "test_train_draft.py",  # 32
    "test_engine.py",  # 30
    "test_spec.py",  # 29
    "test_mhc_kernels.py",  # 27
    "test_hf_parity.py",  # 27
    "test_tensor_parallel.py",  # 26
    "test_server_routers.py",  # 26
    "test_sampling_schedule.py",  # 24
    "test_server.py",  # 19
    "test_cli_and_demo.py",  # 18
    "test_mtp.py",  # 18
    "test_rank_engine.py",  # 18
    "test_tool_calls.py",  # 17
    "test_train.py",  # 16
    "test_moe_decode.py",  # 14
    "test_structured.py",  # 13
    "test_moe_kernels.py",  # 13
    "test_responses.py",  # 13
    "test_token_map.py",  # 12
)


@pytest.hookimpl(trylast=True)  # after pytest's grouping by fixtures, which the stable sort keeps
def pytest_collection_modifyitems(config, items):
    """Orders the longest files first (`LONGEST_FILES_FIRST`; the rest keep their order). On a GPU
    machine, refuses a run that collected the CPU interpreter's kernel tests beside CUDA tests: those
    modules set TRITON_INTERPRET at import (`interpreter.use_interpreter`), which makes every Triton
    kernel of the process an interpreted one, so the CUDA tests would fail for nothing."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    cuda_files = sorted({item.path.name for item in items if item.path.name.endswith("_cuda.py")})
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1" and cuda_files:
        raise pytest.UsageError(
            f"CUDA test files ({', '.join(cuda_files[:3])}, ...) were collected with interpreter test "
            "modules (TRITON_INTERPRET=1 is set at their import): run CUDA test files in their own processes"
        )


@pytest.fixture(autouse=True)
def _same_global_rng():
    """Every test body starts from one global torch RNG state, whatever ran before it in its process:
    `make test` hands files to its two workers in an order that varies, so an unseeded draw differed from
    run to run (test_kda_safe_gate_bounds failed once so, RESULTS S36-2)."""
    torch.manual_seed(0)


# name -> (kpool, index_topk, layer mix, overrides)
PARITY_CONFIGS = {
    "kpool4-shared": (4, 8, "shared", {}),
    "kpool16-shared": (16, 32, "shared", {}),
    "kpool4-dense-moe": (4, 12, "default", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2}),
}


@pytest.fixture(scope="session", params=sorted(PARITY_CONFIGS))
def tiny_checkpoint(request, tmp_path_factory) -> Path:
    kpool, topk, mix, overrides = PARITY_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return write_hf_checkpoint(path, tiny_text_config(kpool, topk, mix, **overrides), seed=len(request.param))


@pytest.fixture(scope="session")
def models(tiny_checkpoint):
    """(hylo model, HF reference model) for one tiny checkpoint, both fp32 on the CPU."""
    import transformers

    transformers.logging.set_verbosity_error()
    return load_model(tiny_checkpoint, dtype=torch.float32, progress=False), hf_model(tiny_checkpoint)


@pytest.fixture
def strict_launch_arguments(monkeypatch):
    """The Triton interpreter ignores keyword arguments a kernel does not declare; the GPU launcher
    raises. Kernel test modules use this (`pytestmark`) so the CPU catches such launches too."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def checked(self, *args, grid, warmup, **kwargs):
        unknown = set(kwargs) - set(self.arg_names) - TRITON_LAUNCH_OPTIONS
        assert not unknown, f"{self.fn.__name__} got undeclared arguments {sorted(unknown)}"
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", checked)


class Caches:
    """Caches for a handful of sequences, each given pages for up to `per_seq` positions."""

    def __init__(self, model, num_seqs: int = 8, per_seq: int = 256, page_size: int = 16):
        config, weight = model.config, model.embed_tokens.weight
        plan = MemoryPlan(num_seqs * per_seq // page_size, page_size, num_seqs, per_seq, 0, 0)
        self.manager = CacheManager(config, plan, weight.dtype, weight.device)
        for _ in range(num_seqs):
            slot = self.manager.acquire_slot()
            assert self.manager.grow(slot, [], per_seq)

    def chunk(self, seq: int, token_ids, prefix_len: int) -> SequenceChunk:
        return SequenceChunk(list(token_ids), prefix_len, seq, seq)

    def forward(self, model, chunks, all_logits: bool = True) -> torch.Tensor:
        m = self.manager
        return model(
            ForwardBatch.build(chunks, m.table.table, m.tokens, m.states, m.kpool, all_logits=all_logits)
        ).logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The random-weight test model (the architecture at small sizes, a tiny tokenizer), written once
    per module."""
    from hylo.models.demo import write_random_model

    path = tmp_path_factory.mktemp("demo")
    write_random_model(path)
    return path


# The random test model cut from 8 layers to 3 that keep one of each kind it has (KDA, DSA with a full
# indexer, DSA reusing it through a shared indexer; a dense MLP and MoE)
SHALLOW_LAYERS = {
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"],
    "indexer_types": ["full", "full", "shared"],
    "mlp_layer_types": ["dense", "sparse", "sparse"],
}


@pytest.fixture(scope="module")
def shallow_model_dir(tmp_path_factory) -> Path:
    """The random test model's tokenizer and config (`write_random_model`) with `SHALLOW_LAYERS` and
    seeded random weights of that depth, written once per module: for tests of what does not depend on
    the depth (a server's API, routing), whose steps cost ~35-40% of the 8-layer model's."""
    import json

    from hylo.config import ModelConfig
    from hylo.models.demo import write_random_model
    from hylo.models.glm5_next import Glm5NextForCausalLM
    from hylo.models.loader import save_checkpoint
    from hylo.models.random_init import randomize

    path = tmp_path_factory.mktemp("shallow")
    write_random_model(path)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"] |= SHALLOW_LAYERS
    model = Glm5NextForCausalLM(ModelConfig.from_dict(raw))
    randomize(model, torch.Generator().manual_seed(0))
    save_checkpoint(model, path, raw)
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline `LLM` of the random test model on the CPU."""
    from hylo import LLM

    return LLM(str(model_dir), device="cpu", page_size=16, max_memory_gb=0.25)


def counted_read(read, reads: list[int]):
    """`read` (a step's one device-to-host read: `Reader.read` or `PendingRead.wait`) run out of the
    sync debug mode's reach, each call made while the mode is on (a strict step's) counted in
    `reads[-1]`."""

    def allowed(*args):
        mode = torch.cuda.get_sync_debug_mode()
        if mode:
            reads[-1] += 1
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(*args)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    return allowed


def without_sync(call, *args):
    """`call(*args)` raising on any synchronising CUDA call."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return call(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def with_one_read(call, reads: list[int], *args):
    """`call(*args)` raising on any synchronising CUDA call but one read (`counted_read`'s), which it
    must make."""
    reads.append(0)
    result = without_sync(call, *args)
    assert reads[-1] == 1
    return result


def strict_steps(monkeypatch, runner, reads: list[int], launches_strictly, collects_strictly) -> None:
    """`runner`'s steps that `launches_strictly(chunks, route)` picks launch without any synchronising
    call, and the launched steps `collects_strictly(launched)` picks are collected with none but their
    one read (counted in `reads`); every other step runs as it would."""
    launch, collect = runner.launch, runner.collect

    def strict_launch(chunks, route):
        return (
            without_sync(launch, chunks, route) if launches_strictly(chunks, route) else launch(chunks, route)
        )

    def strict_collect(launched):
        return with_one_read(collect, reads, launched) if collects_strictly(launched) else collect(launched)

    monkeypatch.setattr(runner, "launch", strict_launch)
    monkeypatch.setattr(runner, "collect", strict_collect)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class EveryKth:
    """A draft-length policy for tests: verify every k-th decode step and draft only in the step
    before it, so that the plain steps between draft nothing (a device proposer defers their
    observes)."""

    def __init__(self, k: int):
        self.k, self.steps = k, 0

    def plan(self, bucket: int):
        from hylo.speculative.adaptive import StepPlan

        n, self.steps = self.steps, self.steps + 1
        return StepPlan(verify=n % self.k == 0, draft=(n + 1) % self.k == 0)

    def record(self, *args) -> None:
        pass


def run_every_kth(llm, prompts, params, k: int, defer: bool) -> tuple[list, list[int], torch.Tensor]:
    """`llm.generate` under `EveryKth(k)`, its plain decode graphs deferring the proposer's observes or
    (`defer` False) observing every step: (outputs, the tokens each catch-up had the proposer observe,
    the token slots of the positions still deferred when their request finished: never observed)."""
    from unittest import mock

    from hylo.engine.cuda_graph import DecodeGraphs

    engine = llm.engine
    engine.policy = EveryKth(k)
    caught_up, catch_up = [], engine.runner.drafting.catch_up
    never, finish = [], engine.scheduler.finish

    def counted(requests):
        caught_up.extend(r.num_computed - r.deferred_from for r in requests if r.deferred_from is not None)
        catch_up(requests)

    def finished(request):
        if request.deferred_from is not None:
            never.append(
                engine.caches.table.table[request.slot, request.deferred_from : request.num_computed]
            )
        finish(request)

    engine.runner.drafting.catch_up, engine.scheduler.finish = counted, finished
    defers = DecodeGraphs.defers if defer else property(lambda self: False)
    with mock.patch.object(DecodeGraphs, "defers", defers):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return outputs, caught_up, torch.cat(never or [torch.zeros(0, dtype=torch.int32)]).long()
