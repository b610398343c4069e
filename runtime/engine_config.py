"""EngineConfig: the one typed configuration of an engine instance (the CLI flags map onto it).

No feature flags elsewhere: every knob the engine, the scheduler or a backend honours is a field
here, with vLLM's names where vLLM has one. The CLI's engine flags (server/cli.py, serve_cmd.py,
chat_cmd.py) take their defaults and choices from here (`EngineConfig()`, DEVICES, DTYPES,
BLOCK_SIZES), so a default is changed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedrun.runtime.lora.errors import LoRAConfigError
from pagedrun.runtime.lora.lora_config import (DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS,
                                               LoRAConfig)
from pagedrun.runtime.spec_decode.spec_config import SpeculativeConfig, SpeculativeConfigError

DEVICES = ("auto", "cpu", "sim", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64)
PREEMPTION_MODES = ("recompute", "swap")
# Who starts the ranks of a parallel group (vLLM's distributed_executor_backend): "mp", our own
# worker processes (runtime/distributed/executor.py); "ray", one Ray actor per rank
# (runtime/distributed/ray_workers.py, the `ray` extra).
EXECUTOR_BACKENDS = ("mp", "ray")
# Weight quantization (vLLM's `quantization`): None / "none" keeps the dtype's weights; "int8"
# is int8 weights made at load from any checkpoint (cpu: Q8_0 blocks, int8 x int8 GEMMs,
# runtime/backends/cpu_int8_backend.py; sim / cuda: W8A16, runtime/backends/weight_only.py);
# "gguf" keeps a .gguf file's GEMM matrices in the file's block types
# (runtime/quantization/gguf_blocks.py, runtime/backends/cpu_gguf_backend.py; cpu only); "awq" /
# "gptq" serve a Hugging Face int4 checkpoint of that quant_method kept int4
# (runtime/quantization/hf_int4.py; the default for such a
# checkpoint): cpu_gemm's I4Z blocks on cpu, W4A16 on sim / cuda. One process, for now.
QUANTIZATIONS = ("none", "int8", "gguf", "awq", "gptq")
# The KV cache's element type (vLLM's kv_cache_dtype). "auto": bfloat16 on the cpu bf16 / int8
# backends (bf16 bits: half the bytes attention reads per decode step, twice the blocks per
# budget), float32 on the float32 cpu backend, the activation dtype on sim / cuda.
# "float32" on the cpu bf16 / int8 backends keeps a float32 cache. "fp8" (alias "fp8_e4m3"):
# uint8 pools of OCP fp8 e4m3 bits on every cpu backend (a quarter of float32's bytes, half of
# bf16's), written round-to-nearest-even saturated to +-448 with vLLM's default per-tensor scale
# 1.0 (no k_scale / v_scale calibration), read widened exactly (runtime/backends/numpy_ops.py);
# not yet on sim / cuda. A combination a backend cannot hold is refused by make_backend
# (runtime/backends/factory.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
# The compiled cpu kernels' instruction-set cap (EngineConfig.cpu_isa; runtime/cpu_isa.py says
# what each level runs), highest first: "auto" caps nothing.
CPU_ISAS = ("auto", "amx", "avx512", "avx2", "portable")
# vLLM's logprobs_mode: raw = from the model's logits before any processing; processed = after
# bias, masks, penalties, temperature and the top-k / top-p / min-p filters (what is sampled).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class EngineConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf; None: the embedded default model
    device: str = "auto"
    # "float32", "bfloat16", "float16"; auto: on cpu a checkpoint's own precision (a .gguf's
    # blocks: model_loader.resolve_quantization; a bf16 checkpoint: bfloat16,
    # backends.checkpoint_dtype), else float32; bf16 on cuda
    dtype: str = "auto"
    quantization: str | None = None  # QUANTIZATIONS; None: "none"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # The cpu kernels' instruction-set cap (runtime/cpu_isa.py: "auto", "amx", "avx512", "avx2",
    # "portable"); "auto": the fastest the CPU runs. Process-wide; cpu backends only.
    cpu_isa: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # explicit KV capacity; None: derived from the memory budget
    # cpu/sim memory budget for KV when num_kv_blocks is None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    swap_space_bytes: int = 0  # host blocks for swap preemption; 0 disables swap
    preemption_mode: str = "recompute"
    tensor_parallel_size: int = 1
    # Pipeline parallelism (runtime/distributed/pipeline.py): the layers in this many stages of
    # tensor_parallel_size ranks each, and as many batches in flight (virtual engines).
    pipeline_parallel_size: int = 1
    # Layers per stage, e.g. (10, 11, 9); None: as even as possible, earlier stages the larger.
    pp_layer_partition: tuple[int, ...] | None = None
    distributed_executor_backend: str = "mp"  # EXECUTOR_BACKENDS
    # Ray's cluster address (`ray start --head` prints it); None: the running cluster on this
    # node if there is one, else a local one started (and stopped) by the engine.
    ray_address: str | None = None
    # Tensor parallel over several nodes (tensor_parallel_size / nnodes ranks each); the control
    # plane's HOST:PORT on node 0 (None: loopback, any free port). runtime/distributed/.
    nnodes: int = 1
    master_addr: str | None = None
    # The shared secret of a multi-node tensor-parallel group: a file (mode 0600, the same on
    # every node; `python -m pagedrun.runtime.distributed.auth FILE` writes one). Required when
    # nnodes > 1; one node makes a fresh secret per launch. runtime/distributed/auth.py.
    tp_secret_file: str | None = None
    tp_curve: bool = False  # CURVE-encrypt the internal tensor-parallel sockets as well
    seed: int = 0
    # Most top logprobs a request may ask for (vLLM's max_logprobs; -1: the whole vocabulary).
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    check_invariants: bool = False  # scheduler invariants after every step (tests turn this on)
    # Multi-LoRA (vLLM's names; runtime/lora/): serve PEFT adapters per request. max_loras
    # device slots (distinct adapters per step), ranks up to max_lora_rank, max_cpu_loras
    # adapters kept loaded on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None
    # Decode graphs (runtime/decode_graphs.py; vLLM's names): a pure-decode step that fits one
    # of these batch sizes replays the forward captured for it at start-up (one launch instead
    # of one per op); larger or mixed steps run eagerly. None: the backend's default (cuda: 1,
    # 2, 4, then every 8 up to min(max_num_seqs, 512); sim: none, as each capture runs a
    # forward on CPU threads; the cpu backends have no graphs). enforce_eager: never capture.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Asynchronous scheduling (runtime/engine/async_stepper.py; vLLM's name): step N+1 is scheduled
    # and launched while step N runs, N's sampled ids read back one step late; the same tokens
    # as synchronous stepping. Kernel backends (cuda; sim proves it) without speculation or
    # parallelism; steps with penalties, min_tokens, bad words or n > 1 run synchronously.
    async_scheduling: bool = False
    # Speculative decoding (vLLM's speculative_config; runtime/spec_decode/spec_config.py): a
    # dict of SpeculativeConfig's fields, e.g. {"method": "ngram", "num_speculative_tokens": 4},
    # or a SpeculativeConfig. None: off. Read through spec_config().
    speculative_config: dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise EngineConfigError(f"device: must be one of {DEVICES}, got {self.device!r}")
        if self.block_size not in BLOCK_SIZES:
            raise EngineConfigError(f"block_size: must be 8, 16, 32 or 64, got {self.block_size}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise EngineConfigError(
                f"logprobs_mode: must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(
                f"quantization: must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise EngineConfigError(f"cpu_isa: must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        if self.max_logprobs < -1:
            raise EngineConfigError(f"max_logprobs: must be >= -1, got {self.max_logprobs}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise EngineConfigError(
                f"preemption_mode: must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.nnodes:
            raise EngineConfigError(
                f"nnodes {self.nnodes} must divide tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size}, the ranks (the same number on each node)")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise EngineConfigError(f"distributed_executor_backend: must be one of "
                                    f"{EXECUTOR_BACKENDS}, got "
                                    f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise EngineConfigError("nnodes: the ray executor places every rank on its cluster's "
                                    "nodes itself; leave nnodes 1 (give master_addr: an address "
                                    "of this node the other nodes reach)")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if (not isinstance(sizes, (tuple, list)) or isinstance(sizes, bool) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)):
                raise EngineConfigError(f"cuda_graph_sizes: must be batch sizes >= 1, got "
                                        f"{sizes!r}")
            self.cuda_graph_sizes = tuple(sorted(set(sizes)))
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition
            if (not isinstance(parts, (tuple, list)) or not all(
                    isinstance(n, int) and n >= 1 for n in parts)
                    or len(parts) != self.pipeline_parallel_size):
                raise EngineConfigError(
                    f"pp_layer_partition: must be {self.pipeline_parallel_size} layer counts "
                    f">= 1 (one per pipeline stage), got {parts!r}")
            self.pp_layer_partition = tuple(parts)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.pipeline_parallel_size > 1:
            if self.speculative_config is not None and (
                    self.spec_config().method == "draft_model"):
                raise EngineConfigError("speculative_config: a draft model is not supported "
                                        "with pipeline_parallel_size > 1 (method 'ngram' is)")
            if self.enable_lora and self.max_loras < self.pipeline_parallel_size:
                # The virtual engines (one per stage) share the device slots, max_loras // P
                # each: each needs one.
                raise EngineConfigError(
                    f"max_loras: {self.max_loras} adapter slots cannot serve "
                    f"{self.pipeline_parallel_size} pipeline virtual engines (max_loras // "
                    f"pipeline_parallel_size each); give max_loras >= "
                    f"{self.pipeline_parallel_size}")
        if self.enable_lora:
            self.lora_config()  # the settings' errors now, naming the field
        if self.speculative_config is not None:
            self.spec_config()  # likewise

    @property
    def world_size(self) -> int:
        """Ranks of the parallel group: pipeline stages x tensor-parallel ranks per stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings when enable_lora, else None."""
        if not self.enable_lora:
            return None
        try:
            return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                              max_cpu_loras=self.max_cpu_loras)
        except LoRAConfigError as exc:
            raise EngineConfigError(str(exc)) from None

    def spec_config(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, or None when speculative_config is None (off)."""
        value = self.speculative_config
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise EngineConfigError(f"speculative_config: must be a dict or a SpeculativeConfig, "
                                    f"got {type(value).__name__}")
        try:
            return SpeculativeConfig.from_dict(value)
        except SpeculativeConfigError as exc:
            raise EngineConfigError(str(exc)) from None
