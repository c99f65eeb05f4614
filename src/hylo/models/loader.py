"""Checkpoint I/O for `glm5_next`: HF model directories of safetensors, bf16/fp32 or FP8 block-scaled.

One table maps every checkpoint tensor to a view of a hylo parameter; loading and saving both walk
it, so the two cannot disagree. Accepted layouts: `Glm5NextForConditionalGeneration`
(`model.language_model.*` + `lm_head.weight`) and flat text-only (`model.*` + `lm_head.weight`).
Vision tensors are skipped; the MTP layer (`layers.{num_hidden_layers}.*`) is skipped by the target
and read on its own by `load_mtp_layer`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from hylo.config import ModelConfig
from hylo.layers.linear import FusedLinear, Linear, unfused_state_dict
from hylo.layers.moe import FP8Experts, MoE, local_experts
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.mtp import MTPLayer, mtp_config
from hylo.models.random_init import randomize
from hylo.ops.fp8 import FP8_BLOCK, quantize_fp8_blocks
from hylo.parallel.layout import SINGLE, Parallel
from hylo.parallel.sharding import VOCAB, Shard, expert_of, projection_split, split_dim

DUMMY_SEED = 0  # `load_format="dummy"`: the target's weights; its MTP layer's come from DUMMY_SEED + 1
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)
_TEXT_PREFIXES = ("model.language_model.", "model.")
_SKIPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.)|\.shared_head\.")
# An `Experts`/`FP8Experts` tensor, every routed expert stacked: the weights or their block scales
_STACKED_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv|)$")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor, the file and what was expected."""


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives: `view(param)` is the destination, `shape` the on-disk shape;
    under tensor parallelism `shard` is the part of it this rank reads (None: all of it)."""

    param: str
    view: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    shard: Shard | None = None


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p


def _rows(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return p[lo:hi]


def _conv_part(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return p[lo:hi].unsqueeze(1)


def _expert_rows(p: torch.Tensor, expert: int, lo: int, hi: int | None) -> torch.Tensor:
    return p[expert, lo:hi]


def _leading_rows(p: torch.Tensor, inner: Callable[[torch.Tensor], torch.Tensor], rows: int) -> torch.Tensor:
    return inner(p)[:rows]


def _expert_layout(
    name: str, stacked: str, suffix: str, shape: tuple[int, ...], first_expert: int
) -> dict[str, Slot]:
    """The per-expert checkpoint tensors of one stacked experts tensor `name` (`...mlp.experts.` +
    `stacked` + `suffix`; suffix `_scale_inv`: an `FP8Experts`' block scales, laid out as its weights):
    `gate_up_proj [E, 2I, ...]` holds each expert's gate rows then its up rows, `down_proj [E, ...]`
    one slice per expert. Expert `e` of the tensor is `first_expert + e` in the checkpoint."""
    prefix = name.removesuffix(stacked + suffix)
    if stacked == "down_proj":
        parts = [("down_proj", 0, None, shape[1:])]
    else:
        half = shape[1] // 2
        parts = [("gate_proj", 0, half, (half, shape[2])), ("up_proj", half, None, (half, shape[2]))]
    layout: dict[str, Slot] = {}
    for e in range(shape[0]):
        for part, lo, hi, part_shape in parts:
            view = partial(_expert_rows, expert=e, lo=lo, hi=hi)
            layout[f"{prefix}{first_expert + e}.{part}.weight{suffix}"] = Slot(name, view, part_shape)
    return layout


def checkpoint_layout(model: Glm5NextForCausalLM | MTPLayer) -> dict[str, Slot]:
    """Checkpoint name (without the `model.language_model.` prefix) -> destination, for every tensor
    this rank holds (`hylo.parallel.sharding`: other ranks' experts are absent, split tensors come
    with their `Shard`)."""
    c = model.config
    parallel = getattr(model, "parallel", SINGLE)
    first_expert = local_experts(c, parallel)[0]
    layout: dict[str, Slot] = {}
    tensors = dict(model.named_parameters(remove_duplicate=True)) | dict(model.named_buffers())
    for module_name, module in model.named_modules():
        if isinstance(module, FusedLinear):  # each part's rows from its own checkpoint tensor
            layout |= _fused_layout(module_name, module)
            for param in ("weight", "dense_weight", "weight_scale_inv"):
                tensors.pop(f"{module_name}.{param}", None)
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        if name.endswith("self_attn.conv_weight"):
            w = shape[0] // 3
            for i, part in enumerate("qkv"):
                view = partial(_conv_part, lo=i * w, hi=(i + 1) * w)
                layout[name.replace("conv_weight", f"{part}_conv1d.weight")] = Slot(
                    name, view, (w, 1, shape[1])
                )
        elif expert_tensor := _STACKED_EXPERTS.search(name):
            layout |= _expert_layout(name, *expert_tensor.groups(), shape, first_expert)
        else:
            key = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
            layout[key] = Slot(name, _whole, shape)
    if c.tie_word_embeddings:
        layout.pop("lm_head.weight", None)
    if parallel.size > 1:
        layout = {key: _sharded(key, slot, c, parallel) for key, slot in layout.items()}
    return layout


def shard_digest(model: Glm5NextForCausalLM) -> str:
    """A digest of this rank's share of the checkpoint (each checkpoint tensor it holds, its on-disk
    shape and the part of it kept) and of the shapes and dtypes it holds them in: two builds hold the
    same share of a model alike exactly when their digests are equal (ranks differ by their shards)."""
    lines = [f"{key} {slot.shape} {slot.shard}" for key, slot in sorted(checkpoint_layout(model).items())]
    tensors = sorted([*model.named_parameters(), *model.named_buffers()])
    lines += [f"{name} {tuple(t.shape)} {t.dtype}" for name, t in tensors]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _fused_layout(module_name: str, module: FusedLinear) -> dict[str, Slot]:
    """The checkpoint tensors of a `FusedLinear`'s parts: each part's rows of the parameter holding
    it, and for FP8 parts the rows of block scales that start at the part's 128-row boundary."""
    k, keys = module.in_features, module.checkpoint_keys(module_name)
    layout = {}
    for part, (param, lo, hi) in module.rows().items():
        key = keys[part]
        layout[key] = Slot(f"{module_name}.{param}", partial(_rows, lo=lo, hi=hi), (hi - lo, k))
        if param == "weight" and module.fp8:
            blocks = partial(_rows, lo=lo // FP8_BLOCK, hi=-(-hi // FP8_BLOCK))
            shape = (-(-(hi - lo) // FP8_BLOCK), -(-k // FP8_BLOCK))
            layout[key + "_scale_inv"] = Slot(f"{module_name}.weight_scale_inv", blocks, shape)
    return layout


def _sharded(key: str, slot: Slot, config: ModelConfig, parallel: Parallel) -> Slot:
    """`slot` (this rank's part, its shape the part's) as a part of the whole on-disk tensor."""
    dim = split_dim(key, parallel)
    if dim is None:
        return slot
    if dim == VOCAB:
        lo, _ = parallel.vocab_span(config.vocab_size)
        rows = min(slot.shape[0], config.vocab_size - lo)  # the last rank's padding rows read nothing
        view = partial(_leading_rows, inner=slot.view, rows=rows)
        return Slot(slot.param, view, (config.vocab_size, *slot.shape[1:]), Shard(0, lo, rows))
    local = slot.shape[dim]
    shape = (*slot.shape[:dim], local * parallel.size, *slot.shape[dim + 1 :])
    return Slot(slot.param, slot.view, shape, Shard(dim, parallel.rank * local, local))


def held_elsewhere(key: str, model: torch.nn.Module) -> bool:
    """Whether checkpoint tensor `key` is a routed expert another rank holds (experts split by expert)."""
    parallel = getattr(model, "parallel", SINGLE)
    expert = expert_of(key)
    if expert is None or not parallel.experts_by_expert:
        return False
    first, count, _ = local_experts(model.config, parallel)
    return not first <= expert < first + count


def _strip_prefix(key: str) -> str:
    if key.startswith("lm_head."):
        return key
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _is_skipped(key: str, num_layers: int) -> bool:
    return bool(_SKIPPED.search(key)) or re.search(rf"(^|\.)layers\.{num_layers}\.", key) is not None


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """e4m3 weight `[N, K]` times its per-[128, 128]-block scale `[ceil(N/128), ceil(K/128)]`; a part of
    a larger weight starting at row, column `offset` takes the whole weight's scales."""
    n, k = weight.shape
    rows = (torch.arange(n) + offset[0]) // FP8_BLOCK
    cols = (torch.arange(k) + offset[1]) // FP8_BLOCK
    return (weight.float() * scale_inv.float()[rows][:, cols]).to(dtype)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in {index.name} but does not exist")
    return files


def load_weights(model: Glm5NextForCausalLM, path: str | Path, progress: bool | None = None) -> int:
    """Stream every tensor of the checkpoint at `path` into `model`, one tensor at a time; under
    tensor parallelism only this rank's parts of them. Returns the bytes read from the files.

    Raises `CheckpointError` for a missing, unexpected or mis-shaped tensor (naming it, its file and
    the expected shape). FP8 weights with a `weight_scale_inv` are dequantised to the parameter dtype,
    except into e4m3 parameters (kept FP8), which take them and their scales as stored.
    """
    num_layers = model.config.num_hidden_layers

    def local_name(raw: str) -> str | None:
        return None if _is_skipped(raw, num_layers) else _strip_prefix(raw)

    return _load_tensors(model, Path(path), checkpoint_layout(model), local_name, progress)


def _load_tensors(
    module: torch.nn.Module,
    path: Path,
    layout: dict[str, Slot],
    local_name: Callable[[str], str | None],
    progress: bool | None,
) -> int:
    """Copy into `module` every checkpoint tensor whose `local_name` is not None (its key in `layout`,
    or another rank's expert); every key of `layout` must be found. Returns the bytes read."""
    files = _checkpoint_files(path)
    read = 0
    params = dict(module.named_parameters()) | dict(module.named_buffers())
    seen: set[str] = set()
    bar = tqdm(
        desc=f"Loading {path.name}",
        unit="tensor",
        total=len(layout),
        disable=progress is False or (progress is None and len(layout) < 2000),
    )
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from e
        with handle as f:
            keys = set(f.keys())
            for raw in sorted(keys):
                key = local_name(raw)
                if key is None or (key.endswith(".weight_scale_inv") and key not in layout):
                    continue  # scales of weights dequantised below
                slot = layout.get(key)
                if slot is None:
                    if held_elsewhere(key, module):
                        continue
                    raise CheckpointError(f"{file.name}: unexpected tensor {raw!r} (not part of the model)")
                part = f.get_slice(raw)
                if tuple(part.get_shape()) != slot.shape:
                    raise CheckpointError(
                        f"{file.name}: tensor {raw!r} has shape {tuple(part.get_shape())}, "
                        f"expected {slot.shape}"
                    )
                tensor = f.get_tensor(raw) if slot.shard is None else part[slot.shard.index()]
                read += tensor.numel() * tensor.element_size()
                dest = slot.view(params[slot.param].data)
                if tensor.dtype == torch.float8_e4m3fn and dest.dtype != torch.float8_e4m3fn:
                    tensor, scale_bytes = _dequantized(f, raw, keys, tensor, file, dest.dtype, slot)
                    read += scale_bytes
                elif dest.dtype == torch.float8_e4m3fn and tensor.dtype != dest.dtype:
                    raise CheckpointError(f"{file.name}: {raw!r} is {tensor.dtype}, FP8 experts need e4m3")
                dest.copy_(tensor.view(dest.shape))
                seen.add(key)
                bar.update()
    bar.close()
    missing = sorted(set(layout) - seen)
    if missing:
        shown = ", ".join(f"{m} {layout[m].shape}" for m in missing[:5])
        raise CheckpointError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. {shown}")
    return read


def _dequantized(
    f, raw: str, keys: set[str], tensor: torch.Tensor, file: Path, dtype: torch.dtype, slot: Slot
) -> tuple[torch.Tensor, int]:
    """`tensor` (the part of `raw` that `slot` reads) dequantised with the whole weight's block scales,
    and the bytes of the scales read (all of them: 1/16384 of the weight's)."""
    scale_key = raw + "_scale_inv"
    if scale_key not in keys:
        raise CheckpointError(f"{file.name}: FP8 tensor {raw!r} has no {scale_key!r} in the same file")
    scale = f.get_tensor(scale_key)
    blocks = tuple(-(-s // FP8_BLOCK) for s in slot.shape)
    if len(slot.shape) != 2 or tuple(scale.shape) != blocks:
        raise CheckpointError(
            f"{file.name}: {scale_key!r} has shape {tuple(scale.shape)}, expected {blocks} "
            "for [128, 128] blocks"
        )
    offset = [0, 0]
    if slot.shard is not None:
        offset[slot.shard.dim] = slot.shard.start
    scale_bytes = scale.numel() * scale.element_size()
    return dequantize_fp8(tensor, scale, dtype, (offset[0], offset[1])), scale_bytes


def save_checkpoint(
    model: Glm5NextForCausalLM, path: str | Path, raw_config: dict, fp8: bool = False
) -> None:
    """Write `model` as an HF `Glm5NextForConditionalGeneration` directory (config + one safetensors
    file). With `fp8`, every 2-D projection weight is stored as block-scaled e4m3."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = checkpoint_tensors(model, checkpoint_layout(model), fp8)
    config = dict(raw_config)
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        }
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def checkpoint_tensors(
    module: torch.nn.Module, layout: dict[str, Slot], fp8: bool = False, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`module`'s tensors on the CPU under their full checkpoint names (`layout`'s keys, prefixed by
    `model.language_model.` except `lm_head.*`). With `fp8`, every 2-D projection weight is stored as
    block-scaled e4m3 with its `_scale_inv`; with `dtype`, the other fp32 parameters are cast to it,
    except those `transformers` keeps in fp32 (buffers keep their dtype)."""
    params = dict(module.named_parameters())
    tensors = params | dict(module.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for key, slot in layout.items():
        tensor = slot.view(tensors[slot.param].data).detach().reshape(slot.shape).contiguous().cpu()
        name = key if key.startswith("lm_head.") else f"model.language_model.{key}"
        if tensor.dtype == torch.float8_e4m3fn:  # kept FP8: written as held, its scales by their own key
            out[name] = tensor
            continue
        if fp8 and _quantizable(key, tensor):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(tensor)
            continue
        if dtype is not None and slot.param in params and tensor.dtype == torch.float32:
            tensor = tensor if _stays_fp32(slot.param) else tensor.to(dtype)
        out[name] = tensor
    return out


def _quantizable(key: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and stored_block_scaled(key)


_BLOCK_SCALED = re.compile(r"(_proj|_proj_with_mqa|\.indexer\.wq_b|\.indexer\.wk)\.weight$")


def stored_block_scaled(key: str) -> bool:
    """Whether an FP8 checkpoint (DeepSeek-V3.2's convention, which `save_checkpoint(fp8=True)` follows)
    stores the projection weight `key` block-scaled: every linear projection but the indexer's head
    weights (`weights_proj`); not the indexer's compress gate (a bare parameter), the router, the
    embedding or the head."""
    return _BLOCK_SCALED.search(key) is not None and not key.endswith("weights_proj.weight")


def fp8_checkpoint_keys(path: str | Path) -> set[str]:
    """The checkpoint's e4m3 tensors that have a `_scale_inv` beside them, by their names without the
    text-model prefix (`checkpoint_layout`'s keys); read from the safetensors headers alone."""
    keys: set[str] = set()
    for file in _checkpoint_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = set(f.keys())
                for name in names:
                    if f.get_slice(name).get_dtype() == "F8_E4M3" and name + "_scale_inv" in names:
                        keys.add(_strip_prefix(name))
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from e
    return keys


def keep_projections_fp8(
    module: torch.nn.Module, is_fp8: Callable[[str], bool], key_of: Callable[[str], str] = str
) -> int:
    """Before allocation (on the meta device): make every quantizable `Linear` of `module` whose
    checkpoint weight `is_fp8` (by its checkpoint name, `key_of` of its layout key) e4m3 with block
    scales, and of a `FusedLinear` the parts that are. A weight that tensor parallelism splits stays
    FP8 only where this rank's part (the whole weight on one rank) is whole [128, 128] blocks along
    the split, so that every rank keeps its own blocks and the layout is the same at any TP that
    divides them; the others (KDA's 64-row b_proj) are dequantised at load, as before. Returns the
    number of projections converted."""

    def fp8(key: str, local_shape: tuple[int, int]) -> bool:
        key = key_of(key)
        dim = projection_split(key)
        return is_fp8(key) and (dim not in (0, 1) or local_shape[dim] % FP8_BLOCK == 0)

    converted = 0
    for name, sub in list(module.named_modules()):
        if not isinstance(sub, Linear) or not sub.quantizable:
            continue
        if isinstance(sub, FusedLinear):
            keys = sub.checkpoint_keys(name)
            parts = [part for part, n in sub.parts if fp8(keys[part], (n, sub.in_features))]
            if parts:
                sub.to_fp8_(parts)
                converted += len(parts)
        elif fp8(f"{name}.weight", (sub.out_features, sub.in_features)):
            sub.to_fp8_()
            converted += 1
    return converted


def _has_fp8_projections(model: torch.nn.Module) -> bool:
    return any(isinstance(m, Linear) and m.fp8 for m in model.modules())


def build_model(
    config: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    parallel: Parallel = SINGLE,
    fp8_experts: bool = False,
    is_fp8: Callable[[str], bool] | None = None,
) -> Glm5NextForCausalLM:
    """The model of `config` as `load_model` builds it before reading a weight: built on the meta
    device as this rank's share (`parallel`), its routed experts `FP8Experts` with `fp8_experts`, every
    projection whose checkpoint weight `is_fp8` e4m3 (`keep_projections_fp8`), then every tensor given
    uninitialised storage on `device` in its final dtype (`dtype`, except what is kept in fp32 or FP8).
    On `device="meta"` it holds no memory: the shapes and dtypes a rank would hold."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, parallel)
        if fp8_experts:  # swapped before allocation: the bf16 experts never take memory
            for layer in model.layers:
                if isinstance(layer.mlp, MoE):
                    layer.mlp.experts = FP8Experts.empty(config, "meta", parallel)
        if config.tie_word_embeddings:  # tied before allocation: one tensor, not two
            model.lm_head.weight = model.embed_tokens.weight
        if is_fp8 is not None:
            keep_projections_fp8(model, is_fp8)
    return _materialize(model, device, dtype)


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    progress: bool | None = None,
    fp8_experts: bool | None = None,
    random_weights: bool = False,
    parallel: Parallel = SINGLE,
    fp8_projections: bool | None = None,
) -> Glm5NextForCausalLM:
    """Build the model from `path/config.json` without initialising weights, then load them. With
    `fp8_experts` (an FP8 checkpoint) the routed experts stay e4m3 with their block scales
    (`FP8Experts`, run by the FP8 grouped GEMMs) instead of being dequantised to `dtype`; by default
    they do on CUDA whenever the checkpoint is block-FP8 and its experts are whole [128, 128] blocks.
    `random_weights` fills seeded random weights instead of reading any (`load_format="dummy"`: a
    real-size model to benchmark from its config.json alone; under tensor parallelism every rank draws
    the same stream into its own shapes, so they are not TP=1's weights). `parallel`: this rank's share
    (`hylo.parallel.sharding`); it reads only that part of the checkpoint. With `fp8_projections`
    (by default on CUDA for an FP8 checkpoint) every projection the checkpoint stores block-scaled stays
    e4m3 and runs the FP8 GEMMs (`keep_projections_fp8`); for random weights, those an FP8 checkpoint
    would store so."""
    config = ModelConfig.from_dir(path)
    on_gpu = torch.device(device).type == "cuda"
    fp8_checkpoint = (config.quantization_config or {}).get("quant_method") == "fp8"
    if fp8_experts is None:
        fp8_experts = on_gpu and fp8_checkpoint and config.moe_intermediate_size % FP8_BLOCK == 0
    if fp8_projections is None:
        fp8_projections = on_gpu and fp8_checkpoint
    is_fp8 = None
    if fp8_projections:
        is_fp8 = stored_block_scaled if random_weights else fp8_checkpoint_keys(path).__contains__
    model = build_model(config, device, dtype, parallel, fp8_experts, is_fp8)
    if random_weights:
        randomize(model, torch.Generator(device).manual_seed(DUMMY_SEED))
    else:
        load_weights(model, path, progress)
    return model.eval()


def build_mtp_layer(
    target_config: ModelConfig,
    mlp: str,
    device: str | torch.device,
    dtype: torch.dtype,
    parallel: Parallel = SINGLE,
    own_embedding: bool = False,
    own_head: bool = False,
    fp8_experts: bool = False,
    is_fp8: Callable[[str], bool] | None = None,
) -> MTPLayer:
    """The MTP layer after a target of `target_config` as `load_mtp_layer` builds it before reading a
    weight (its MLP `mlp`, "dense" or "sparse"; with its own embedding or head where the checkpoint
    stores them), as `build_model` builds the target: FP8 routed experts with `fp8_experts`, e4m3
    projections where `is_fp8` (by the checkpoint names under `layers.{num_hidden_layers}.`)."""
    with torch.device("meta"):
        layer = MTPLayer(mtp_config(target_config, mlp), own_embedding, own_head, parallel)
        if fp8_experts and isinstance(layer.decoder.mlp, MoE):
            layer.decoder.mlp.experts = FP8Experts.empty(layer.config, "meta", parallel)
        if is_fp8 is not None:
            prefix = f"layers.{target_config.num_hidden_layers}."
            keep_projections_fp8(layer, is_fp8, partial(mtp_checkpoint_key, prefix=prefix))
    return _materialize(layer, device, dtype)


def load_mtp_layer(
    path: str | Path, target: Glm5NextForCausalLM, progress: bool | None = None, random_weights: bool = False
) -> MTPLayer:
    """The MTP (next-n) layer stored after the target's layers: `layers.{num_hidden_layers}.*` under
    any prefix the target loader accepts (see `hylo.models.mtp` for the names), on the target's device
    and in its dtype (its routed experts in FP8 when the target's are). Raises `CheckpointError` when
    the checkpoint has no such layer, one that is not a DSA layer with its own indexer, or a missing
    or unexpected tensor in it.

    `random_weights` (`load_format="dummy"`) reads nothing from `path` (the config is the target's):
    a layer with the MLP of the target's last layer that uses the target's embedding and head (where
    DeepSeek-V3-style checkpoints store copies of them), filled from its own seed."""
    path = Path(path)
    n = target.config.num_hidden_layers
    prefix = f"layers.{n}."
    if random_weights:
        mlp, own_embedding, own_head = target.config.mlp_layer_types[-1], False, False
    else:
        names = _mtp_tensor_names(path, n)
        mlp = "sparse" if "mlp.gate.weight" in names else "dense"
        own_embedding, own_head = "embed_tokens.weight" in names, "shared_head.head.weight" in names
    # FP8 routed experts and projections where the target keeps its own (an FP8 checkpoint's MTP layer
    # is FP8 too)
    is_fp8 = None
    if _has_fp8_projections(target):
        is_fp8 = stored_block_scaled if random_weights else fp8_checkpoint_keys(path).__contains__
    weight = target.embed_tokens.weight
    layer = build_mtp_layer(
        target.config, mlp, weight.device, weight.dtype, target.parallel,
        own_embedding, own_head, _has_fp8_experts(target), is_fp8,
    )  # fmt: skip
    if random_weights:
        randomize(layer, torch.Generator(weight.device).manual_seed(DUMMY_SEED + 1))
        return layer.eval()
    layout = mtp_layout(layer, n)

    def local_name(raw: str) -> str | None:
        key = _strip_prefix(raw)
        return key if key.startswith(prefix) else None

    _load_tensors(layer, path, layout, local_name, progress)
    return layer.eval()


def mtp_layout(layer: torch.nn.Module, num_target_layers: int) -> dict[str, Slot]:
    """`checkpoint_layout` of an MTP layer (an `MTPLayer`, or a module with its parameter names) as the
    target's checkpoint stores it: below `layers.{num_target_layers}.`, the decoder layer's tensors
    without their `decoder.` prefix. `load_mtp_layer` reads this layout and MTP training writes it."""
    prefix = f"layers.{num_target_layers}."
    return {mtp_checkpoint_key(key, prefix): slot for key, slot in checkpoint_layout(layer).items()}


def mtp_checkpoint_key(key: str, prefix: str) -> str:
    return prefix + key.removeprefix("decoder.")


def _has_fp8_experts(model: Glm5NextForCausalLM) -> bool:
    return any(isinstance(getattr(layer.mlp, "experts", None), FP8Experts) for layer in model.layers)


def _mtp_tensor_names(path: Path, n: int) -> set[str]:
    """The checkpoint's tensor names below `layers.{n}.` (the MTP layer), checked to describe a DSA layer."""
    prefix = f"layers.{n}."
    names = {key[len(prefix) :] for key in map(_strip_prefix, _tensor_names(path)) if key.startswith(prefix)}
    if not names:
        raise CheckpointError(
            f"{path}: no MTP layer: no tensor named model.layers.{n}.* or model.language_model.layers.{n}.* "
            f"(the next-n layer after the target's {n} layers, which speculative_algorithm MTP runs)"
        )
    for needed in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wk.weight"):
        if needed not in names:
            raise CheckpointError(
                f"{path}: MTP layer tensor {prefix}{needed} is missing: hylo runs the MTP layer as a DSA "
                "(indexed_attention) layer with its own indexer"
            )
    return names


def _tensor_names(path: Path) -> list[str]:
    names = []
    for file in _checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from e
    return names


def _materialize(module: ModuleT, device: str | torch.device, dtype: torch.dtype) -> ModuleT:
    """Give every parameter and buffer of a meta-built `module` uninitialised storage on `device`, each
    allocated once in its final dtype: `dtype` for the parameters built in fp32 except those
    `transformers` keeps in fp32; any other parameter and every buffer as built (FP8 experts, fp32
    biases). Allocating in the build dtype and casting afterwards would hold the whole model in fp32
    first. Tied parameters stay tied."""
    made: dict[int, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, meta in table.items():
                if meta is None:
                    continue
                if id(meta) not in made:
                    cast = is_param and meta.dtype == torch.float32 and not _stays_fp32(f"{prefix}.{name}")
                    # FP8 weights start as zeros: the rows between a fused projection's parts are read
                    make = torch.zeros if meta.dtype == torch.float8_e4m3fn else torch.empty
                    data = make(meta.shape, dtype=dtype if cast else meta.dtype, device=device)
                    made[id(meta)] = torch.nn.Parameter(data, meta.requires_grad) if is_param else data
                table[name] = made[id(meta)]
    return module


def _stays_fp32(name: str) -> bool:
    """Parameters `transformers` keeps in fp32 whatever the model dtype."""
    return name.endswith(("conv_weight", "dt_bias", "A_log", "_hc.base", "_hc.scale"))


def load_flat(module: torch.nn.Module, path: str | Path) -> None:
    """Load a checkpoint whose tensor names are `module`'s parameter names, a `FusedLinear`'s parts under
    their own (`unfused_state_dict`; draft models), with the same checks as `load_weights`: every
    tensor present, none unexpected, every shape right."""
    path = Path(path)
    params = unfused_state_dict(module)  # views of the parameters' storage
    seen: set[str] = set()
    for file in _checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from e
        with handle as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if key not in params:
                    raise CheckpointError(f"{file.name}: unexpected tensor {key!r} (not part of the model)")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[key].shape):
                    raise CheckpointError(
                        f"{file.name}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(params[key].shape)}"
                    )
                params[key].data.copy_(tensor)
                seen.add(key)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. "
            + ", ".join(f"{m} {tuple(params[m].shape)}" for m in missing[:5])
        )
