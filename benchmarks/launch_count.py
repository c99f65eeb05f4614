"""Kernel launches of one decode step, layer by layer, counted on the CPU (no GPU needed).

    .venv/bin/python benchmarks/launch_count.py [--layers 8] [--batch 1] [--by-op] [--fp8]
    .venv/bin/python benchmarks/launch_count.py --engine plain,dflash,dflash2,mtp3

`--engine`: one whole engine step of the shipped demo model instead (a decode step of one request,
or a verify step with its drafting for the next, through the fixed-shape graph paths run uncaptured,
adaptive policy off), split into the target's layers, the rest of the target, the draft model (or
MTP layer) and what runs outside every module (batch metadata, sampling, acceptance, commits).

A small GLM-5.3-Flash of the real layer order (`ModelConfig.from_dict` defaults: KDA where idx % 4 != 3,
dense MLPs in layers 0-2, MoE after; the demo's widths, parameters in bf16 but those the loader keeps
fp32) prefills a prompt on the reference path, then runs one
fixed-shape decode step (the batch a decode graph replays, counted at its second run: what a capture
records, after the first run's one-time set-up) with every op family dispatched as on the
GPU: each module's `use_kernel` is replaced by one that treats the tensors as CUDA and still asks the
kernel's verifier, and the Triton kernels run under `TRITON_INTERPRET=1`. Counted, attributed to the
innermost module running:

- every Triton launch (`InterpretedFunction.run`), as one kernel;
- every aten op a `TorchDispatchMode` sees outside a Triton launch, as one CUDA kernel, except views
  (ops whose schema returns an alias of an input), allocations (`empty*`, which launch nothing) and
  `_local_scalar_dense` (a host read, reported apart: a graph cannot capture it).

`--fp8`: the projections an FP8 checkpoint stores block-scaled are e4m3 (`load_model(fp8_projections=
True)`), the rest as an FP8 checkpoint loads them (b_proj's rows, the dense part of `in_proj`, stay bf16),
and every `ops.gemm.linear` call counts as one launch (`gemm.linear_fp8` or `gemm.linear`), not as the
CPU's dequantisation ops.

What this cannot see, and so differs from a replay's kernel table (benchmarks/RESULTS.md S16-2): the
projections here are one launch each (bf16 `F.linear`, or one `ops.gemm.linear` with `--fp8`); under
capture a product whose Triton configuration splits K also launches its sum (the bf16 dense parts of FP8
`FusedLinear`s do, RESULTS S30-4). A few aten ops launch more than one kernel on CUDA (sort, some
index_put_), counted as one here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from interpreter import use_interpreter

use_interpreter()  # before any kernel module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# allocations and metadata changes: no device work
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach_",
    "_unsafe_view",  # a reshape whose result owns no new storage (a linear over a 3-D input ends in one)
}
HOST_READ = "_local_scalar_dense"
# dispatchers that ask the CUDA runtime itself: left on their CPU path (a bf16 projection is one
# `F.linear` launch on either path; see the module docstring for FP8)
CUDA_ONLY_DISPATCH = {"hylo.ops.gemm"}


@dataclass
class Launches:
    """Launches by (module path, kind, name); kind is "triton" (name: op family.kernel), "gemm" (with
    `--fp8`: one `ops.gemm.linear` call) or "torch" (name: the aten op). `host_reads`: ops that read a
    device value back on the host, by module."""

    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    host_reads: Counter[str] = field(default_factory=Counter)

    def of(self, prefix: str) -> Counter[tuple[str, str, str]]:
        """The launches of the modules under `prefix` (a module path, e.g. "layers.3")."""
        return Counter({key: n for key, n in self.counts.items() if _under(key[0], prefix)})

    def total(self, prefix: str = "") -> int:
        return sum(self.of(prefix).values())


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _launches_a_kernel(func: torch._ops.OpOverload) -> bool:
    if func.__name__.split(".")[0] in NO_KERNEL:
        return False
    returns = func._schema.returns
    if not any(isinstance(r.type, torch.TensorType) or "Tensor" in str(r.type) for r in returns):
        return False  # a query (result_type, sizes): no device work
    is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return not is_view


class _AtenCounter(TorchDispatchMode):
    def __init__(self, launches: Launches, where: list[str]):
        super().__init__()
        self.launches, self.where, self.paused = launches, where, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # seen here before its decomposition (inference mode): count what it runs
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        if not self.paused:
            name = func.__name__.split(".")[0]
            if name == HOST_READ:
                self.launches.host_reads[self.where[-1]] += 1
            elif _launches_a_kernel(func):
                self.launches.counts[self.where[-1], "torch", name] += 1
        return func(*args, **kwargs)


def _forced_use_kernel(op: str, tensor: torch.Tensor, verify=None, **log_names) -> bool:
    """`dispatch.use_kernel` as a CUDA tensor would see it: the verifier decides (`log_names`, the kernel
    and fallback names of its log line, change nothing)."""
    return verify is None or verify() is None


@contextlib.contextmanager
def kernels_dispatched_as_on_cuda() -> Iterator[None]:
    """Every loaded `hylo.ops` module's `use_kernel` forced as for CUDA tensors (see the docstring)."""
    from hylo.ops import dispatch

    patched = [
        m for name, m in list(sys.modules.items())
        if name.startswith("hylo.ops.") and name not in CUDA_ONLY_DISPATCH
        and getattr(m, "use_kernel", None) is dispatch.use_kernel
    ]  # fmt: skip
    for module in patched:
        module.use_kernel = _forced_use_kernel
    try:
        yield
    finally:
        for module in patched:
            module.use_kernel = dispatch.use_kernel


def _leave(where: list[str]) -> None:
    """A forward hook's body: the module is done (returning None keeps its output)."""
    where.pop()


@contextlib.contextmanager
def projections_counted(launches: Launches, where: list[str], counter: _AtenCounter) -> Iterator[None]:
    """Every loaded hylo module's `ops.gemm.linear` replaced by one that counts a call as one launch (the
    GPU's one GEMM) into `launches` at `where[-1]`, its CPU ops (an FP8 weight's dequantisation) unseen."""
    from hylo.ops import gemm

    def counted(x, weight, scale_inv=None, dense_part=False):
        launches.counts[where[-1], "gemm", "gemm.linear_fp8" if scale_inv is not None else "gemm.linear"] += 1
        counter.paused += 1
        try:
            return gemm.linear(x, weight, scale_inv, dense_part)
        finally:
            counter.paused -= 1

    users = [m for name, m in list(sys.modules.items()) if name.startswith("hylo.") and m is not gemm
             and getattr(m, "linear", None) is gemm.linear]  # fmt: skip
    for module in users:
        module.linear = counted
    try:
        yield
    finally:
        for module in users:
            module.linear = gemm.linear


@contextlib.contextmanager
def counting(model: torch.nn.Module, launches: Launches, projections: bool = False) -> Iterator[None]:
    """Count into `launches` what runs inside the block, attributed to `model`'s innermost module; with
    `projections`, each `ops.gemm.linear` call as one launch (`projections_counted`)."""
    from triton.runtime.interpreter import InterpretedFunction

    where = [""]
    counter = _AtenCounter(launches, where)
    hooks = []
    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: where.append(n)))
        hooks.append(module.register_forward_hook(lambda m, a, o: _leave(where)))
    run = InterpretedFunction.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            family = self.fn.__module__.removeprefix("hylo.ops.").split(".")[0]
            launches.counts[where[-1], "triton", f"{family}.{self.fn.__name__}"] += 1
        counter.paused += 1  # the interpreter's own tensor work is not the kernel's launches
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter.paused -= 1

    InterpretedFunction.run = counted_run
    try:
        with (
            counter,
            projections_counted(launches, where, counter) if projections else contextlib.nullcontext(),
        ):
            yield
    finally:
        InterpretedFunction.run = run
        for hook in hooks:
            hook.remove()


def slice_dir(layers: int, path: Path) -> Path:
    """A config.json in `path`: the real model's layer order at small sizes (the demo's widths)."""
    from hylo.models import demo

    sizes = {k: v for k, v in demo._TEXT_CONFIG.items() if not k.endswith("_types")}
    text = sizes | {"vocab_size": 256, "pad_token_id": 0, "num_hidden_layers": layers}
    (path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    return path


def decode_step_launches(
    layers: int = 8, batch: int = 1, dtype: torch.dtype = torch.bfloat16, prompt: int = 9, fp8: bool = False
) -> tuple[Launches, object]:
    """(launches of one fixed-shape decode step of `batch` sequences, the model): the model loaded as
    served (`load_model` with random weights: parameters in `dtype` but those kept fp32; with `fp8` the
    projections as an FP8 checkpoint keeps them, each product one launch: see the module docstring)."""
    from hylo.forward_batch import FixedShape, ForwardBatch, SequenceChunk
    from hylo.memory.manager import CacheManager, MemoryPlan
    from hylo.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(
            slice_dir(layers, Path(tmp)), dtype=dtype, random_weights=True, fp8_projections=fp8
        )
    config = model.config
    page, per_seq = 16, 64
    plan = MemoryPlan(batch * per_seq // page, page, batch, per_seq, 0, 0, scratch=True)
    caches = CacheManager(config, plan, dtype, "cpu")
    slots = [caches.acquire_slot() for _ in range(batch)]
    for slot in slots:
        assert caches.grow(slot, [], per_seq)
    ids = torch.randint(2, config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    def step_batch(chunks, fixed=None):
        args = (caches.table.table, caches.tokens, caches.states, config.index_kpool)
        return ForwardBatch.build(chunks, *args, fixed=fixed)

    def step(chunks):
        return model(step_batch(chunks))

    step([SequenceChunk(ids, 0, s, s) for s in slots])
    fixed = FixedShape(batch, per_seq // config.index_kpool, caches.scratch_slot, kpool=config.index_kpool)
    decode = step_batch([SequenceChunk([7], prompt, s, s) for s in slots], fixed)
    with kernels_dispatched_as_on_cuda():  # as before a capture: one-time set-up (MoE ticket zeros) runs here
        model(decode)
    launches = Launches()
    with kernels_dispatched_as_on_cuda(), counting(model, launches, projections=fp8):
        model(decode)
    return launches, model


def report(launches: Launches, model, by_op: bool) -> None:
    config = model.config
    per_layer = []
    for i, layer in enumerate(model.layers):
        kind = (
            ("KDA" if layer.is_linear else "DSA") + "+" + config.mlp_layer_types[i].replace("sparse", "MoE")
        )
        n = launches.total(f"layers.{i}")
        per_layer.append(n)
        families = Counter()
        for (_, kind_, name), count in launches.of(f"layers.{i}").items():
            families[name.split(".")[0] if kind_ != "torch" else "torch ops"] += count
        print(
            f"layer {i} ({kind}): {n} launches ({', '.join(f'{f} {c}' for f, c in sorted(families.items()))})"
        )
        if by_op:
            rows = Counter()
            for (path, kind_, name), count in launches.of(f"layers.{i}").items():
                rows[path.removeprefix(f"layers.{i}").lstrip(".") or "(layer)", kind_, name] += count
            for (path, kind_, name), count in sorted(rows.items()):
                print(f"    {count:3d}  {kind_:6s} {name:32s} {path}")
    outside = launches.total() - sum(per_layer)
    print(f"per layer: mean {sum(per_layer) / len(per_layer):.1f}; outside the layers: {outside}; "
          f"whole step: {launches.total()}")  # fmt: skip
    if launches.host_reads:
        print(f"host reads (not capturable): {dict(launches.host_reads)}")


ENGINE_ALGORITHMS = {
    "plain": {},
    "dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash"},
    "dflash2": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash2"},
    "mtp3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3},
}


def engine_step_launches(algorithm: str, warm_steps: int = 3) -> Launches:
    """Launches of one engine step of the demo model (see the module) after `warm_steps` steps of a
    40-token prompt; module paths start with "target" or "draft", "" outside both."""
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.models.demo import default_model_dir
    from hylo.sampling import SamplingParams

    model = default_model_dir()
    options = dict(ENGINE_ALGORITHMS[algorithm])
    if "speculative_draft_model_path" in options:
        options["speculative_draft_model_path"] = str(model / options["speculative_draft_model_path"])
    if options:
        options["speculative_adaptive"] = False
    config = EngineConfig.from_kwargs(model=str(model), device="cpu", dtype="float32", **options)
    engine = Engine(config, decode_graphs=True)
    prompt = torch.randint(2, 8000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(warm_steps):
        engine.step()
    modules = torch.nn.ModuleDict({"target": engine.model})
    proposer = engine.proposer
    draft = getattr(proposer, "draft", None) or getattr(proposer, "layer", None)
    if draft is not None:
        modules["draft"] = draft
    launches = Launches()
    with kernels_dispatched_as_on_cuda(), counting(modules, launches):
        engine.step()
    engine.close()
    return launches


def engine_report(algorithm: str, launches: Launches, by_op: bool = False) -> None:
    layers = sum(n for (path, _, _), n in launches.counts.items() if _under(path, "target.layers"))
    parts = {
        "target layers": layers,
        "target, outside its layers": launches.total("target") - layers,
        "draft": launches.total("draft"),
        "outside every module": launches.total() - launches.total("target") - launches.total("draft"),
    }
    print(
        f"{algorithm}: {launches.total()} launches a step ({', '.join(f'{k} {v}' for k, v in parts.items())})"
    )
    if by_op:  # what runs outside the target's layers, by module path and op
        rows = Counter()
        for (path, kind, name), count in launches.counts.items():
            if not _under(path, "target.layers"):
                rows[path or "(outside every module)", kind, name] += count
        for (path, kind, name), count in sorted(rows.items()):
            print(f"    {count:3d}  {kind:6s} {name:32s} {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--by-op", action="store_true", help="launches by module and op (--engine: outside the layers)"
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="the projections e4m3 as an FP8 checkpoint keeps them (decode step)",
    )
    parser.add_argument(
        "--engine", default=None, help=f"count engine steps instead: some of {list(ENGINE_ALGORITHMS)}"
    )
    args = parser.parse_args()
    if args.engine:
        for algorithm in args.engine.split(","):
            engine_report(algorithm, engine_step_launches(algorithm), args.by_op)
        return
    launches, model = decode_step_launches(args.layers, args.batch, getattr(torch, args.dtype), fp8=args.fp8)
    report(launches, model, args.by_op)


if __name__ == "__main__":
    main()
