"""Model configuration: GLM-5.3-Flash (`glm5_next`) text config parsed from an HF `config.json`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
INDEXED = "indexed_attention"


@dataclass(frozen=True)
class ModelConfig:
    """The text model of `glm5_next`, with defaults and schedules resolved as `transformers` 5.23 does.

    Invariants (checked in `__post_init__`): every per-layer list has `num_hidden_layers` entries;
    a `shared` indexer layer directly follows a `full` indexed layer (the only place the HF model
    carries top-k rows from); `index_topk` is a multiple of `index_kpool`; NoPE (no rotary dims).
    """

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    indexer_types: list[str] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"config.{name} has {len(getattr(self, name))} entries, expected {n}")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError(
                f"config.index_topk ({self.index_topk}) must be a multiple of "
                f"index_kpool ({self.index_kpool})"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (LINEAR, INDEXED):
                raise ValueError(f"config.layer_types[{i}] = {kind!r}, expected {LINEAR!r} or {INDEXED!r}")
            if kind == INDEXED and self.indexer_types[i] == "shared" and not self._full_indexed(i - 1):
                raise ValueError(
                    f"config.indexer_types[{i}] is 'shared' but layer {i - 1} is not a 'full' indexed layer"
                )
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in ("dense", "sparse"):
                raise ValueError(f"config.mlp_layer_types[{i}] = {kind!r}, expected 'dense' or 'sparse'")
        if self.n_routed_experts % self.n_group:
            raise ValueError("config.n_routed_experts must be a multiple of n_group")

    def _full_indexed(self, i: int) -> bool:
        return i >= 0 and self.layer_types[i] == INDEXED and self.indexer_types[i] == "full"

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == INDEXED]

    @property
    def indexer_layers(self) -> list[int]:
        """DSA layers that run their own indexer (and own indexer caches)."""
        return [i for i in self.dsa_layers if self.indexer_types[i] == "full"]

    @property
    def row_width(self) -> int:
        """Selected rows per query: top-k tokens plus the incomplete tail pool."""
        tail = self.index_kpool - 1 if self.index_kpool_always_select_tail else 0
        return self.index_topk + tail

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF `glm5_next` config: nested (`text_config`) or flat text-only."""
        text = dict(raw.get("text_config") or raw)
        if "quantization_config" in raw and "quantization_config" not in text:
            text["quantization_config"] = raw["quantization_config"]
        n = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        if text.get("layer_types") is None:
            text["layer_types"] = [LINEAR if i % 4 != 3 else INDEXED for i in range(n)]
        text["layer_types"] = [INDEXED if t == "full_attention" else t for t in text["layer_types"]]
        if text.get("mlp_layer_types") is None:
            text["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if text.get("indexer_types") is None:
            text["indexer_types"] = _indexer_schedule(text, n)
        linear = text.get("linear_attn_config")
        if linear:
            text.setdefault("linear_head_dim", linear.get("head_dim", cls.linear_head_dim))
            text.setdefault("linear_num_heads", linear.get("num_heads", cls.linear_num_heads))
            text.setdefault("linear_conv_kernel_dim", linear.get("short_conv_kernel_size", 4))
            bound = linear.get("gate_lower_bound")
            if bound is None and linear.get("safe_gate", True):
                bound = -5.0
            text.setdefault("linear_lower_bound", bound)
        if text.get("qk_rope_head_dim", 0):
            raise ValueError(f"config.qk_rope_head_dim = {text['qk_rope_head_dim']}: glm5_next is NoPE")
        if text.get("num_key_value_heads", text.get("num_attention_heads")) != text.get(
            "num_attention_heads"
        ):
            raise ValueError("config.num_key_value_heads must equal num_attention_heads")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in text.items() if k in known})

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a model directory needs a config.json")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        model_type = raw.get("model_type")
        if model_type not in ("glm5_next", "glm5_next_text"):
            raise ValueError(f"{file}: model_type {model_type!r} is not supported (expected 'glm5_next')")
        return cls.from_dict(raw)


def _indexer_schedule(text: dict[str, Any], n: int) -> list[str]:
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return (
            [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        )
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


DEFAULT_CUDA_GRAPH_MAX_BS = 256


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _flag(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting. Each field is also a `hylo` CLI flag (`--page-size` for `page_size`) and
    an `LLM(...)` keyword."""

    model: str | None = _flag(
        None,
        "HF model directory; default: the embedded demo model (a 7M-parameter GLM-5.3-Flash trained on "
        "ShareGPT, with its drafts)",
    )
    tokenizer: str | None = _flag(None, "tokenizer directory (default: the model directory)")
    load_format: str = _flag(
        "auto", "auto (the checkpoint's safetensors) or dummy (seeded random weights from config.json alone)"
    )
    fp8_projections: str = _flag(
        "auto",
        "projections an FP8 checkpoint stores block-scaled: auto (kept e4m3 and run as FP8 GEMMs on "
        "CUDA, dequantised to the model dtype on CPU) or dequantize (the model dtype everywhere)",
    )
    device: str = _flag("auto", "cpu, cuda, cuda:N or auto (cuda when available)")
    dtype: str = _flag("auto", "bfloat16, float16, float32 or auto (bfloat16 on GPU, float32 on CPU)")
    page_size: int = _flag(64, "tokens per cache page (a multiple of the indexer's k-pool size)")
    chunked_prefill_size: int = _flag(
        8192, "prompt tokens one step may prefill, summed over requests, while any request is decoding"
    )
    idle_prefill_size: int | None = _flag(
        None,
        "prompt tokens one step may prefill while no request is decoding (no token's latency waits on the "
        "step; fewer, longer steps read each weight fewer times a prompt); default: twice "
        "chunked_prefill_size",
    )
    max_running_requests: int | None = _flag(
        None,
        "requests decoding at once (default: what half the memory budget's state slots allow, at most 256)",
    )
    mem_fraction_static: float = _flag(
        0.85, "GPU: fraction of the device memory that weights and caches may take together"
    )
    max_memory_gb: float = _flag(2.0, "CPU: GiB for the caches (token pages and request state slots)")
    context_length: int | None = _flag(None, "longest sequence, prompt + output (default: the model's)")
    disable_cuda_graph: bool = _flag(
        False, "run decode steps eagerly instead of as CUDA-graph replays (the graphs are CUDA only)"
    )
    cuda_graph_max_bs: int | None = _flag(
        None,
        "largest decode batch run as a CUDA-graph replay; larger ones run eagerly "
        f"(default: {DEFAULT_CUDA_GRAPH_MAX_BS}, at most the running-request limit)",
    )
    cuda_graph_max_prefill_tokens: int = _flag(
        1024,
        "longest prefill chunk of a step that prefills one request alone run as a CUDA-graph replay "
        "(token buckets from 16 up to it); 0: every prefill runs eagerly",
    )
    skip_warmup: bool = _flag(
        False,
        "start without warming up: on CUDA the engine runs one eager step of each shape class before it is "
        "ready, so that no request pays for compiling kernels (SGLang's --skip-server-warmup)",
    )
    disable_radix_cache: bool = _flag(
        False, "no prefix cache: every request computes its whole prompt (SGLang's flag name)"
    )
    disable_overlap_schedule: bool = _flag(
        False,
        "run each decode step to its end before scheduling the next (for debugging); by default the "
        "host schedules and launches step N+1 while the device runs step N (SGLang's flag name)",
    )
    mixed_steps: str = _flag(
        "auto",
        "whether a step with prefill work (a prompt going on, a request that can start) also runs the "
        "decoding requests: on (prefill chunks join the decoding rows in one eagerly run step), off (it "
        "runs only prefill, one prompt's chunk in the prefill graphs while few prompts wait, and the "
        "decoding requests go on in the next step as a graph replay) or auto (on without speculative "
        "decoding, off with it: measured in RESULTS S26)",
    )
    prefix_snapshot_interval: int = _flag(
        1024,
        "prefix cache: a long prefill keeps a snapshot of the KDA states every this many tokens (a "
        "multiple of page_size); a prompt's last full page always keeps one",
    )
    seed: int = _flag(0, "seed of the sampler for requests that bring no seed of their own")
    indexer_dtype: str = _flag(
        "auto", "pooled indexer keys: auto (the model dtype) or fp8 (e4m3, per-row scales)"
    )
    speculative_algorithm: str | None = _flag(
        None,
        "speculative decoding: DFLASH (DFlash and DFlash2 drafts) or MTP (the model checkpoint's own "
        "next-n layer, layers.{num_hidden_layers}.*; no draft path)",
    )
    speculative_draft_model_path: str | None = _flag(None, "draft model directory (DFLASH only)")
    speculative_num_draft_tokens: int | None = _flag(
        None,
        "DFLASH verify block (`VerifyShape.block`): the anchor + drafts verified per step (default: the "
        "draft's block_size); "
        "with MTP it may only be given as speculative_num_steps + 1",
    )
    speculative_num_steps: int | None = _flag(
        None, "MTP: chained MTP forwards per verify step, one draft token each (default 1)"
    )
    speculative_token_map: str | None = _flag(
        None,
        "drafts pick only from these token ids (a torch.save'd 1-D tensor, SGLang's format, or a JSON list; "
        "`hylo token-map` makes one): the draft reads those rows of the vocabulary head instead of all; "
        "the target verifies every token, so outputs are unchanged",
    )
    speculative_adaptive: bool = _flag(
        True,
        "per step, verify the drafts or decode plainly, whichever the measured step costs and the running "
        "acceptance length say is faster (--no-speculative-adaptive: always verify)",
    )
    tp_size: int = _flag(
        1, "tensor parallelism: ranks that split every layer (one process and GPU each; README: Parallelism)"
    )
    ep_size: int | None = _flag(
        None, "routed experts: tp_size splits them by expert (the default), 1 splits each expert by tensor"
    )
    sequence_parallel_tokens: int = _flag(
        512,
        "with tp_size > 1, a step of at least this many tokens keeps each rank's share of the tokens' "
        "residual streams: its blocks' sums are reduce-scattered and their inputs all-gathered (the bytes "
        "of an all-reduce), so mHC and the norms run on 1/tp_size of the tokens; 0: always all-reduce",
    )
    nnodes: int = _flag(1, "hosts the tp_size ranks span (each runs the same command with its node_rank)")
    node_rank: int = _flag(0, "this host's index among nnodes (host 0 serves)")
    dist_init_addr: str | None = _flag(
        None,
        "host:port of node 0 where the ranks meet (required with nnodes > 1; default: a free local port)",
    )
    dist_timeout: float = _flag(
        60.0, "seconds a collective may wait for the other ranks before the engine fails"
    )

    def __post_init__(self) -> None:
        positive = (
            "page_size",
            "chunked_prefill_size",
            "idle_prefill_size",
            "max_running_requests",
            "context_length",
            "cuda_graph_max_bs",
            "speculative_num_draft_tokens",
            "speculative_num_steps",
            "prefix_snapshot_interval",
            "tp_size",
            "nnodes",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.idle_prefill_size is not None and self.idle_prefill_size < self.chunked_prefill_size:
            raise ValueError(
                f"idle_prefill_size ({self.idle_prefill_size}) must be at least chunked_prefill_size "
                f"({self.chunked_prefill_size}): a step with no request decoding may only prefill more"
            )
        if not isinstance(self.cuda_graph_max_prefill_tokens, int) or self.cuda_graph_max_prefill_tokens < 0:
            value = self.cuda_graph_max_prefill_tokens
            raise ValueError(f"cuda_graph_max_prefill_tokens must be an int >= 0, got {value!r}")
        flags = (
            "disable_cuda_graph",
            "skip_warmup",
            "speculative_adaptive",
            "disable_radix_cache",
            "disable_overlap_schedule",
        )
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.max_memory_gb <= 0:
            raise ValueError(f"max_memory_gb must be > 0, got {self.max_memory_gb}")
        self._check_speculative()
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ValueError("speculative_num_draft_tokens must be >= 2 (the anchor and at least one draft)")
        if self.prefix_snapshot_interval % self.page_size:
            raise ValueError(
                f"prefix_snapshot_interval ({self.prefix_snapshot_interval}) must be a multiple of "
                f"page_size ({self.page_size})"
            )
        self._check_parallel()
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.mixed_steps not in ("auto", "on", "off"):
            raise ValueError(f"mixed_steps must be auto, on or off, got {self.mixed_steps!r}")
        if self.fp8_projections not in ("auto", "dequantize"):
            raise ValueError(f"fp8_projections must be auto or dequantize, got {self.fp8_projections!r}")
        if self.indexer_dtype not in ("auto", "fp8"):
            raise ValueError(f"indexer_dtype must be auto or fp8, got {self.indexer_dtype!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")

    def _check_parallel(self) -> None:
        if not isinstance(self.sequence_parallel_tokens, int) or self.sequence_parallel_tokens < 0:
            value = self.sequence_parallel_tokens
            raise ValueError(f"sequence_parallel_tokens must be an int >= 0, got {value!r}")
        if self.ep_size not in (None, 1, self.tp_size):
            raise ValueError(f"ep_size must be 1 or tp_size ({self.tp_size}), got {self.ep_size}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required with nnodes > 1")
        if self.dist_init_addr is not None and not _host_port(self.dist_init_addr):
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm not in (None, "DFLASH", "MTP"):
            raise ValueError(f"speculative_algorithm must be DFLASH or MTP, got {algorithm!r}")
        if algorithm == "DFLASH" and not self.speculative_draft_model_path:
            raise ValueError("speculative_draft_model_path is required with speculative_algorithm DFLASH")
        if algorithm == "MTP" and self.speculative_draft_model_path:
            raise ValueError(
                "speculative_draft_model_path must not be set with speculative_algorithm MTP: the MTP "
                "layer is read from the model checkpoint"
            )
        if self.speculative_token_map is not None and algorithm is None:
            raise ValueError("speculative_token_map needs a speculative_algorithm (DFLASH or MTP)")
        if self.speculative_num_steps is not None and algorithm != "MTP":
            raise ValueError(
                f"speculative_num_steps applies to speculative_algorithm MTP only, got {algorithm!r}"
            )
        steps = self.speculative_num_steps or 1
        if algorithm == "MTP" and self.speculative_num_draft_tokens not in (None, steps + 1):
            raise ValueError(
                f"speculative_num_draft_tokens ({self.speculative_num_draft_tokens}) must be "
                f"speculative_num_steps + 1 ({steps + 1}) with speculative_algorithm MTP"
            )

    @property
    def longest_prefill_step(self) -> int:
        """Prompt tokens a step may prefill while no request decodes, the largest prefill step (what the
        warm-up compiles up to): `idle_prefill_size`, by default twice `chunked_prefill_size` (H100, 8-layer
        slice: a lone 13312-token prompt in one step instead of 8192 + 5120 reaches its first token 3.4%
        sooner, each expert read once; benchmarks/RESULTS.md S46-2)."""
        return self.idle_prefill_size or 2 * self.chunked_prefill_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: Any) -> None:
        """One `--flag` per field, typed by its annotation; a bool field is a switch."""
        for f in fields(cls):
            flag, kind = f"--{f.name.replace('_', '-')}", str(f.type).split(" |")[0]
            if kind == "bool":  # a switch; one that defaults to on also gets its --no- form
                action = argparse.BooleanOptionalAction if f.default else "store_true"
                parser.add_argument(flag, action=action, default=f.default, help=f.metadata["help"])
                continue
            parser.add_argument(
                flag,
                type={"int": int, "float": float, "str": str}[kind],
                default=f.default,
                help=f.metadata["help"],
            )

    @classmethod
    def from_cli(cls, namespace: Any) -> EngineConfig:
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})
