"""Sizes of a model under tensor and expert parallelism, computed from meta-device shapes: the weights
each rank holds, what that leaves of a GPU for caches, and the device collectives of one step.

Weights are counted on the model as `load_model` would build it for an FP8 checkpoint on CUDA
(`loader.build_model` on the meta device): the layers built with this rank's `Parallel` (no
collectives run), the routed experts `FP8Experts` (e4m3 weights, fp32 block scales), the projections
an FP8 checkpoint stores block-scaled e4m3, every other tensor in its final dtype (bf16, except what
`transformers` keeps in fp32, and buffers as built). The MTP layer is built as
`load_mtp_layer(..., random_weights=True)` builds it (`loader.build_mtp_layer`): the MLP of the
target's last layer, no embedding or head of its own (it uses the target's), FP8 routed experts and
projections like the target's.

Used by `tp_plan.py` and `rank_projection.py` beside it, and checked by `tests/test_tp_sizing.py`.

Collectives (read from the layers; `tests/test_tp_sizing.py` also counts them in a traced forward):

- target forward over T tokens: one all-reduce of `[T, hidden]` in the embedding
  (`VocabEmbedding`), one after each attention block's `o_proj` (`KDAAttention`, `SparseMLA`) and one
  after each MLP / MoE block (`MLP`, `MoE`: routed and shared partial sums reduced together), all in the
  weight dtype; then one all-gather of the `[rows, ceil(vocab / tp)]` logits of the rows the step
  samples (`VocabHead.forward`, in the weight dtype; `.float()` comes after the gather).
- one chained MTP draft step over R rows: the target's embedding of the step's token (1 all-reduce),
  the MTP decoder layer (2), and the greedy draft (`VocabHead.argmax`: one all-gather of `[R, 2]`
  fp32, each rank's maximum and its id). An MTP observe over T tokens: 3 all-reduces.
- a DFlash draft over R rows of a B-token block: the target's embedding of the block (1 all-reduce of
  `[R·B, hidden]`; the draft layers are replicated, no collectives) and the argmax of B−1 rows per
  block (1 all-gather of `[R·(B−1), 2]`).

Besides these, rank 0 broadcasts a 4-integer step header over a gloo (host) group each step
(`hylo.parallel.control`); that is not NVLink traffic and is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from hylo.config import ModelConfig
from hylo.layers.linear import FusedLinear
from hylo.layers.moe import FP8Experts
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import build_model, build_mtp_layer, stored_block_scaled
from hylo.models.mtp import MTPLayer, mtp_config
from hylo.ops.fp8 import FP8_BLOCK
from hylo.parallel.layout import Parallel

DTYPE = torch.bfloat16

# --- the GPU ---------------------------------------------------------------------------------------
# One H200 as the lent `nvidia-h200` machines are described: "about 139 GiB of GPU memory". It is the
# smallest figure in play, so the margins below are conservative: nvidia-smi reads 143771 MiB
# (140.4 GiB) per H200 on the multi-GPU machines, the datasheet says 141 GB; benchmarks/RESULTS.md
# records no total.
GPU_BYTES = 139 * 2**30
NVIDIA_SMI_BYTES = 143771 * 2**20
# Held back per GPU beside weights and caches (an estimate to measure on the GPUs, not a reading):
ALLOWANCE_PARTS = {
    "CUDA context and cuBLAS / Triton workspaces": 1 * 2**30,
    "NCCL buffers (4 MiB per channel and ring peer, LL/LL128 buffers)": 2**30 // 2,
    "decode + verify CUDA graph pool (0.18-0.88 GiB on the 8-layer slice, RESULTS.md S8)": 1 * 2**30,
    "activations of one 8192-token prefill chunk (hc streams [8192, 4, 4096] 0.25 GiB a copy, "
    "65536 MoE pairs × 4096 bf16 0.5 GiB a tensor, indexer scores)": 7 * 2**30 // 2,
}
ALLOWANCE_BYTES = sum(ALLOWANCE_PARTS.values())
MEM_FRACTION_STATIC = 0.85  # EngineConfig's default: weights + caches take at most this share
CUDA_CONTEXT_BYTES = ALLOWANCE_PARTS["CUDA context and cuBLAS / Triton workspaces"]

# --- NVLink collectives ----------------------------------------------------------------------------
# Ring all-reduce bus bandwidth on H100/H200 NVLink 4 (450 GB/s per direction, 900 GB/s both): NCCL's
# maintainer, "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective
# NVLink bandwidth of 370GB/s ... with NCCL_ALGO=RING" (https://github.com/NVIDIA/nccl-tests/issues/212);
# measured 365-370 GB/s for 2-8 GPUs with NCCL_ALGO=RING on 8×H100 SXM
# (https://github.com/NVIDIA/nccl/issues/1455). NVLink SHARP (NVLS, ~480 GB/s on 8 GPUs) is off on the
# machines lent here (NCCL_NVLS_ENABLE=0, KINDS.md), so the ring figure applies.
RING_BUSBW = 370e9
BUSBW_SOURCE = "https://github.com/NVIDIA/nccl-tests/issues/212, https://github.com/NVIDIA/nccl/issues/1455"
# NCCL's own latency model (src/graph/tuning.cc, NVIDIA/nccl master 5067397, 2026-06): a ring collective
# costs baseLatency + steps × hwLatency[NVLink], steps = 2(n−1) for all-reduce and n−1 for all-gather.
# This is the device-side floor NCCL picks algorithms by (what a CUDA-graph replay sees).
NCCL_RING_BASE_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
NCCL_RING_NVLINK_HOP_US = {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}
LATENCY_SOURCE = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc"
# Measured eager (launched from Python, no graph) PyTorch/NCCL all-reduce on 8×H100: ~20-25 us for
# 4 B through 1 MiB (https://github.com/marin-community/marin/issues/6736); larger messages are
# bandwidth-bound and keep NCCL's modelled latency in the eager figure.
EAGER_COLLECTIVE_US = 20.0
EAGER_MAX_BYTES = 2**20
EAGER_SOURCE = "https://github.com/marin-community/marin/issues/6736"
# Above this message size NCCL's model prefers the Simple protocol to LL (LL moves data at ~1/4 of
# the bus bandwidth); the latency term uses that protocol's latency.
LL_MAX_BYTES = 2 * 2**20

ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"


def full_config() -> ModelConfig:
    """GLM-5.3-Flash's text model with every default (45 layers, 288 experts, hidden 4096)."""
    return ModelConfig.from_dict({})


# --- weights ---------------------------------------------------------------------------------------


class _NoInit(TorchFunctionMode):
    """Meta tensors hold no values, so `torch.nn.init` is skipped on them (on meta, `nn.Embedding`'s
    `normal_` runs a Python reference that imports `torch._dynamo`: seconds on a small CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_target(config: ModelConfig, parallel: Parallel) -> Glm5NextForCausalLM:
    """This rank's target on the meta device, in the dtypes `load_model` gives an FP8 checkpoint."""
    with _NoInit():
        return build_model(config, "meta", DTYPE, parallel, fp8_experts=True, is_fp8=stored_block_scaled)


def build_mtp(config: ModelConfig, parallel: Parallel) -> MTPLayer:
    """This rank's MTP layer on the meta device, as `load_mtp_layer(random_weights=True)` builds it."""
    mlp = config.mlp_layer_types[-1]
    with _NoInit():
        return build_mtp_layer(
            config, mlp, "meta", DTYPE, parallel, fp8_experts=True, is_fp8=stored_block_scaled
        )


@dataclass(frozen=True)
class TensorSize:
    shape: tuple[int, ...]
    nbytes: int
    routed_expert: bool


def tensor_sizes(module: torch.nn.Module) -> dict[str, TensorSize]:
    """Every parameter and buffer of `module`, once (a tied tensor under its first name); a
    `FusedLinear`'s tensors part by part (`fused_part_sizes`), since under tensor parallelism one may
    hold parts split by head beside whole ones."""
    experts = {
        id(t) for sub in module.modules() if isinstance(sub, FP8Experts) for t in sub.buffers(recurse=False)
    }
    seen: set[int] = set()
    sizes = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FusedLinear):
            sizes |= fused_part_sizes(name, sub)
            seen |= {id(t) for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        sizes[name] = TensorSize(tuple(t.shape), t.numel() * t.element_size(), id(t) in experts)
    return sizes


def fused_part_sizes(name: str, module: FusedLinear) -> dict[str, TensorSize]:
    """A `FusedLinear`'s bytes by checkpoint tensor (each part's rows, an FP8 part's block scales under
    its key + `_scale_inv`, as `checkpoint_layout` names them) and the zero rows between FP8 parts
    (`{name}.weight[padding]`, with their scale rows): together its tensors' bytes."""
    k, keys = module.in_features, module.checkpoint_keys(name)
    sizes, held = {}, 0
    for part, (param, lo, hi) in module.rows().items():
        element = getattr(module, param).element_size()
        sizes[keys[part]] = TensorSize((hi - lo, k), (hi - lo) * k * element, False)
        held += (hi - lo) * k * element
        if param == "weight" and module.fp8:
            scale = module.weight_scale_inv
            blocks = (-(-(hi - lo) // FP8_BLOCK), scale.shape[1])
            sizes[keys[part] + "_scale_inv"] = TensorSize(
                blocks, blocks[0] * blocks[1] * scale.element_size(), False
            )
            held += blocks[0] * blocks[1] * scale.element_size()
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    padding = sum(t.numel() * t.element_size() for t in tensors) - held
    if padding:
        sizes[f"{name}.weight[padding]"] = TensorSize((padding,), padding, False)
    return sizes


def rank_tensor_sizes(config: ModelConfig, tp: int, ep: int, rank: int) -> dict[str, TensorSize]:
    """This rank's target tensors and its MTP layer's (under `mtp.`); built once per config and rank."""
    key = (repr(config), tp, ep, rank)
    if key not in _SIZES:
        parallel = Parallel(rank, tp, ep, None)
        sizes = tensor_sizes(build_target(config, parallel))
        sizes |= {f"mtp.{k}": v for k, v in tensor_sizes(build_mtp(config, parallel)).items()}
        _SIZES[key] = sizes
    return _SIZES[key]


_SIZES: dict[tuple, dict[str, TensorSize]] = {}


@dataclass(frozen=True)
class RankWeights:
    """Bytes one rank holds: the target's routed experts (FP8 + scales), the target's other weights,
    and the MTP layer (all of it; `mtp_routed_experts` of that its FP8 experts)."""

    tp: int
    ep: int
    rank: int
    routed_experts: int
    other: int
    mtp: int
    mtp_routed_experts: int

    @property
    def target(self) -> int:
        return self.routed_experts + self.other

    @property
    def total(self) -> int:
        return self.target + self.mtp


def rank_weights(config: ModelConfig, tp: int, ep: int, rank: int) -> RankWeights:
    sizes = rank_tensor_sizes(config, tp, ep, rank)
    target = [s for k, s in sizes.items() if not k.startswith("mtp.")]
    mtp = [s for k, s in sizes.items() if k.startswith("mtp.")]
    return RankWeights(
        tp, ep, rank,
        routed_experts=sum(s.nbytes for s in target if s.routed_expert),
        other=sum(s.nbytes for s in target if not s.routed_expert),
        mtp=sum(s.nbytes for s in mtp),
        mtp_routed_experts=sum(s.nbytes for s in mtp if s.routed_expert),
    )  # fmt: skip


@dataclass(frozen=True)
class RankMemory:
    """One GPU of a (tp, ep) engine: the largest rank's weights and what is left for caches."""

    weights: RankWeights
    ranks_equal: bool
    kda_state_per_slot: int  # this rank's KDA heads, every KDA layer
    tokens_per_token: float  # target's DSA caches (replicated: the MLA latent is shared by the heads)
    mtp_tokens_per_token: float  # the MTP layer's DSA caches

    @property
    def left_after_weights(self) -> int:
        return GPU_BYTES - self.weights.total

    @property
    def left_for_caches(self) -> int:
        return self.left_after_weights - ALLOWANCE_BYTES

    @property
    def engine_budget(self) -> int:
        """What the engine would give the caches at its default `mem_fraction_static` (its own reserve
        of 1 − 0.85 of the GPU in place of the allowance; the CUDA context counts as in use)."""
        return int(MEM_FRACTION_STATIC * GPU_BYTES) - self.weights.total - CUDA_CONTEXT_BYTES

    def tokens_with_slots(self, slots: int, mtp: bool = True) -> int:
        """Token-cache capacity of `left_for_caches` once `slots` request slots' KDA states are paid."""
        per_token = self.tokens_per_token + (self.mtp_tokens_per_token if mtp else 0)
        return max(0, int((self.left_for_caches - slots * self.kda_state_per_slot) // per_token))


def rank_memory(config: ModelConfig, tp: int, ep: int) -> RankMemory:
    ranks = [rank_weights(config, tp, ep, r) for r in range(tp)]
    largest = max(ranks, key=lambda w: w.total)
    equal = len({(w.routed_experts, w.other, w.mtp) for w in ranks}) == 1
    local = Parallel(0, tp, ep, None).local_config(config)
    return RankMemory(
        largest,
        equal,
        StateCache.bytes_per_slot(local, DTYPE),
        TokenCache.bytes_per_token(config, DTYPE, None),
        TokenCache.bytes_per_token(mtp_config(config, config.mlp_layer_types[-1]), DTYPE, None),
    )


# --- communication ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind. `message_bytes`: an all-reduce's tensor (every rank holds it
    whole), an all-gather's gathered output (`tp` ranks' parts side by side), a reduce-scatter's or an
    all-to-all's input (each rank sends (tp-1)/tp of it, as an all-gather of that size)."""

    kind: str
    count: int
    message_bytes: int
    what: str

    def sent_per_rank(self, tp: int) -> float:
        """Bytes each rank sends in a ring: 2(n−1)/n of the message per all-reduce, (n−1)/n of the
        output per all-gather."""
        if tp == 1:
            return 0.0
        factor = 2 * (tp - 1) / tp if self.kind == ALL_REDUCE else (tp - 1) / tp
        return self.count * factor * self.message_bytes

    def protocol(self) -> str:
        return "LL" if self.message_bytes <= LL_MAX_BYTES else "Simple"

    def latency_us(self, tp: int) -> float:
        """`count` × NCCL's modelled ring latency for this size's protocol."""
        if tp == 1:
            return 0.0
        steps = 2 * (tp - 1) if self.kind == ALL_REDUCE else tp - 1
        p = self.protocol()
        return self.count * (NCCL_RING_BASE_US[p] + steps * NCCL_RING_NVLINK_HOP_US[p])

    def eager_latency_us(self, tp: int) -> float:
        """`count` × the measured eager latency (messages up to `EAGER_MAX_BYTES`; above, the model's)."""
        if tp == 1:
            return 0.0
        if self.message_bytes > EAGER_MAX_BYTES:
            return self.latency_us(tp)
        return self.count * EAGER_COLLECTIVE_US


def target_step(config: ModelConfig, tp: int, tokens: int, rows: int, itemsize: int = 2) -> list[Collective]:
    """A target forward over `tokens` tokens sampling `rows` logits rows."""
    per_rank_vocab = -(-config.vocab_size // tp)
    return [
        Collective(ALL_REDUCE, 1 + 2 * config.num_hidden_layers, tokens * config.hidden_size * itemsize,
                   "embedding + o_proj and MLP of every layer"),
        Collective(ALL_GATHER, 1, tp * rows * per_rank_vocab * itemsize, "logits"),
    ]  # fmt: skip


def _argmax(tp: int, rows: int) -> list[Collective]:
    """`VocabHead.argmax`: each rank's maximum and its id of every row as one fp32 pair, gathered
    (`[rows, 2·tp]`)."""
    return [Collective(ALL_GATHER, 1, tp * rows * 2 * 4, "argmax (maximum, id) pairs (fp32)")]


def mtp_draft_step(config: ModelConfig, tp: int, rows: int, itemsize: int = 2) -> list[Collective]:
    """One chained MTP draft step over `rows` rows: embed, decoder layer, greedy draft."""
    return [
        Collective(ALL_REDUCE, 3, rows * config.hidden_size * itemsize, "embedding + MTP o_proj and MoE"),
        *_argmax(tp, rows),
    ]


def mtp_observe(config: ModelConfig, tokens: int, itemsize: int = 2) -> list[Collective]:
    return [Collective(ALL_REDUCE, 3, tokens * config.hidden_size * itemsize, "embedding + MTP layer")]


def dflash_draft(config: ModelConfig, tp: int, rows: int, block: int, itemsize: int = 2) -> list[Collective]:
    """A DFlash draft of `rows` blocks of `block` tokens (the draft layers are replicated)."""
    return [
        Collective(ALL_REDUCE, 1, rows * block * config.hidden_size * itemsize, "embedding of the block"),
        *_argmax(tp, rows * (block - 1)),
    ]


@dataclass(frozen=True)
class StepComm:
    collectives: int
    sent_per_rank: float
    bandwidth_us: float  # at RING_BUSBW
    latency_us: float  # NCCL's model
    eager_latency_us: float  # EAGER_COLLECTIVE_US per small collective


def step_comm(collectives: list[Collective], tp: int) -> StepComm:
    sent = sum(c.sent_per_rank(tp) for c in collectives)
    return StepComm(
        sum(c.count for c in collectives) if tp > 1 else 0,
        sent,
        sent / RING_BUSBW * 1e6,
        sum(c.latency_us(tp) for c in collectives),
        sum(c.eager_latency_us(tp) for c in collectives),
    )
