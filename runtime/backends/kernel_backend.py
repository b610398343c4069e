"""KernelBackend: the model's ops on the cuda/*.cu kernels, over a device runtime -- the one
backend class of the sim and cuda devices.

    backend = KernelBackend(HarnessRuntime(), "float32")        # device "sim": CPU threads
    backend = KernelBackend(CupyRuntime(device_id), "bfloat16")  # device "cuda": a GPU

Everything above the device -- op dispatch, weight placement, graph capture and replay
(runtime/backends/graph_capture.py), the KV budget around profile_run, the kernel sampler,
asynchronous scheduling's deferred reads, the communicator's stream -- is here, so CI executes
all of it on the harness runtime; the runtime (runtime/backends/device_runtime.py) allocates,
copies, launches, captures and replays. The launch wrappers in runtime/kernels/ take the
runtime's arrays (numpy or cupy) alike.

Dtypes: activations, weights and KV pools in the backend dtype -- float32 (the kernels' fp32
test instantiations), float16, or bfloat16 stored as uint16 bits; the residual stream and the
logits in float32. With kv_cache_dtype "fp8" / "fp8_e4m3" the KV pools are uint8 fp8 e4m3 codes
(scale 1.0): the rotary kernel rounds k and v to e4m3 as it stores them, the attention kernels
widen what they read (the _kv_fp8 instantiations), the block moves copy bytes.
Weights arrive as the model's float32 numpy arrays (llama.py keeps the `w_t.T` views
`linear_weight` handed back, and passes them each call); each is converted at its first use,
once, to a contiguous HF [out, in] matrix (the layout the skinny decode GEMM streams; MoE
expert stacks stay [E, out, in]), and kept keyed by the array's memory. Shapes a kernel does not
serve (head_dim, block_size) are refused by `check_model` at start-up.
With quantization "awq" / "gptq" (float16 / bfloat16 only) the checkpoint's int4 projections
arrive as QuantizedMatrix "I4Z" and stay int4: `linear_weight` packs and places them once
(runtime/backends/weight_only.py), `linear` runs cuda/gemm_wq.cu's W4A16 GEMM on them;
"int8" quantizes the float GEMM weights at load for its W8A16 GEMM.

The KV budget: on a runtime with device memory (cuda),

    budget = utilization x total - memory in use before - weights - peak of a max-size step

measured around the runner's `profile_run` (`kv_cache_budget_bytes`; the module function of
that name is the arithmetic); on the harness, the fixed host budget.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from pagedrun.runtime.engine_config import EngineConfigError
from pagedrun.runtime.quantization import QuantizedMatrix
from pagedrun.runtime.kernels import attention, cache_ops, fused_ops, gemm, lora, moe
from pagedrun.runtime.kernels.attention import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS
from pagedrun.runtime.kernels.kernel_args import (FP8_KV_DTYPE, UnsupportedKernelShape,
                                                  from_bf16_bits, to_bf16_bits)
from pagedrun.runtime.errors import PagedRunError

from . import numpy_ops, weight_only
from .base import DEFAULT_HOST_KV_CACHE_BYTES, BackendCapabilities
from .graph_capture import capture_graph
from .kernel_sampler import KernelSampler
from .step_inputs import DeviceInts, StepInputs, upload_step

log = logging.getLogger("pagedrun.kernels")
# Largest decode batch captured by default on a GPU (vLLM's default capture cap is 512 too):
# past it a step's launches are a small part of its time.
MAX_GRAPH_BATCH = 512

# kv_cache_dtype -> the pools' element dtype (None: the activation dtype). fp8 / fp8_e4m3
# (vLLM's name and its explicit alias): uint8 e4m3 codes.
KV_DTYPES = {"auto": None, "fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}
_ACTIVATION_DTYPE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                     "bfloat16": np.dtype(np.uint16)}
# Kernel sources per op group (one module each, built on first use).
_SOURCES = {"gemm": ("gemm.cu", "gemm_skinny.cu"), "norm": ("rms_norm.cu",),
            "activation": ("activation.cu",), "embedding": ("embedding.cu",),
            "rotary": ("rotary_cache_write.cu",), "decode": ("paged_attention_decode.cu",),
            "prefill": ("paged_attention_prefill.cu",), "blocks": ("block_copy.cu",),
            "sampling": ("sampling.cu",), "moe": ("moe.cu",), "lora": ("lora.cu",),
            "rejection": ("rejection_sample.cu",), "wq": ("gemm_wq.cu",)}
# Sources a GPU module adds: the Hopper GEMM runs only on sm_90 (runtime/kernels/gemm.py
# dispatches to it there), so the CPU harness does not compile it into the engine's module.
_CUDA_ONLY_SOURCES = {"gemm": ("gemm_hopper.cu",)}
# EngineConfig.quantization values served here (runtime/backends/weight_only.py, on
# cuda/gemm_wq.cu): AWQ / GPTQ int4 checkpoints, their projections kept int4 (W4A16); int8
# made at load from float weights (W8A16).
WEIGHT_ONLY_METHODS = ("awq", "gptq", "int8")


class KernelBackend:
    """Ops on the kernels over a device runtime (harness: the sim device; CuPy: cuda)."""

    # The kernel sampler reads logits where they are; only token ids come back.
    logits_on_device = True
    # What the instance declares (BackendCapabilities; `compute_stream` is the runtime's):
    # - verification rows take the prefill kernel: it reads a sequence's KV once for its 1 + k
    #   queries, where 1 + k decode rows would read it 1 + k times (bandwidth is the GPU's
    #   limit), so verify_as_decode_rows is False;
    # - no spec_disable_by_batch_size: a GPU's decode step is bandwidth-bound, so
    #   verification's extra tokens are nearly free at any batch the engine runs
    #   (speculative_config may still set a limit);
    # - decode steps may replay captured graphs (`graph_capture`), with host steps in them
    #   (`host_call`);
    # - the sampler can leave token ids on the device (asynchronous scheduling).
    _CAPABILITIES = BackendCapabilities(graphs=True, async_scheduling=True, host_call=True,
                                        quantized_gemms=frozenset(WEIGHT_ONLY_METHODS))

    def __init__(self, runtime, dtype_name: str, *, kv_cache_dtype: str = "auto",
                 quantization: str | None = None) -> None:
        """runtime: the device runtime (HarnessRuntime or CupyRuntime). kv_cache_dtype:
        "auto" (KV pools in the activation dtype) or "fp8" / "fp8_e4m3" (uint8 pools of e4m3
        codes). quantization: None / "none", or "awq" / "gptq" (the
        model's int4 projections kept int4: W4A16 GEMMs) or "int8" (W8A16, quantized at load);
        all with float16 / bfloat16 activations."""
        if dtype_name not in _ACTIVATION_DTYPE:
            raise ValueError(f"dtype must be one of {tuple(_ACTIVATION_DTYPE)}, got {dtype_name!r}")
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
        quantization = None if quantization == "none" else quantization
        if quantization is not None:
            if quantization not in WEIGHT_ONLY_METHODS:
                raise EngineConfigError(f"quantization {quantization!r}: the {self.name} "
                                        f"backend serves {WEIGHT_ONLY_METHODS} (or none)")
            if dtype_name == "float32":  # the weight-only kernels take 16-bit activations
                what = "int8" if quantization == "int8" else "awq/gptq"
                raise EngineConfigError(f"quantization: {what} on sim/cuda need dtype float16 "
                                        "or bfloat16, got float32")
        self.quantization = quantization
        self.dtype_name = dtype_name
        self.act_dtype = _ACTIVATION_DTYPE[dtype_name]
        self.kv_dtype = KV_DTYPES[kv_cache_dtype] or self.act_dtype
        self.runtime = runtime
        self.name = runtime.name  # "sim" | "cuda": logs and model info
        self.communicator = runtime.communicator
        self.capabilities = dataclasses.replace(self._CAPABILITIES,
                                                compute_stream=runtime.stream is not None)
        self._modules: dict[str, object] = {}
        self._weights: dict[tuple, tuple[np.ndarray, object]] = {}
        # Every graph's allocations (graph_capture): private, so a replay's buffers are never
        # handed to anything else.
        self.graph_pool = None

    @property
    def xp(self):
        """The runtime's array module (while the harness captures, its recording numpy)."""
        return self.runtime.xp

    @property
    def stream(self):
        """The compute stream (NCCL collectives go on it); None on the harness."""
        return self.runtime.stream

    # ------------------------------------------------------------------ placement
    def module(self, group: str):
        """The op group's kernel module: its launches go through the runtime (a capture
        holds every one of them)."""
        if group not in self._modules:
            sources = list(_SOURCES[group])
            if self.name == "cuda":
                sources += _CUDA_ONLY_SOURCES.get(group, ())
            self._modules[group] = self.runtime.load_module(sources)
        return self._modules[group]

    # ------------------------------------------------------------------ graphs
    def default_graph_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """Decode batch sizes captured when the config names none. On a GPU: 1, 2, 4, then
        every 8 up to min(max_num_seqs, MAX_GRAPH_BATCH) (a decode batch runs in the smallest
        size that holds it, at most 7 padded rows past 8). The harness: none (each capture
        runs a forward on CPU threads; tests and `cuda_graph_sizes` ask for sizes)."""
        if not self.runtime.graphs_by_default:
            return ()
        cap = min(max_num_seqs, MAX_GRAPH_BATCH)
        return tuple(s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap)

    def graph_capture(self):
        """Context manager: the launches (and array copies) of its body captured into the
        CapturedGraph it yields (runtime/backends/graph_capture.py)."""
        return capture_graph(self)

    def host_call(self, fn, *args):
        """fn(*args) on the host (e.g. a collective over the CPU communicator): its result;
        while the harness captures, also a step of the graph (replayed on the same arrays,
        into the same result array); a GPU capture refuses it."""
        return self.runtime.host_call(fn, args)

    def graph_output(self, array):
        """The output of a captured graph as its replays will fill it (cuda: a non-owning view
        into the graph pool, whose later captures reuse the buffer -- sound because replays run
        one at a time on the one stream and each output is consumed before the next replay;
        owned outputs would hold [size, vocab] float32 for every size. The harness: the array
        itself, which the graph holds)."""
        return self.runtime.graph_output(array, self.graph_pool)

    def scatter_ids(self, dst, positions: np.ndarray, src, src_rows: np.ndarray) -> None:
        """dst[positions] = src[src_rows] on the device (int32 token ids; asynchronous
        scheduling's input tokens from the previous step's sampled ids)."""
        xp = self.xp
        dst[xp.asarray(positions)] = src[xp.asarray(src_rows)]

    def upload_into(self, dst, host: np.ndarray) -> None:
        """Copy host values into an existing device array (a graph's static input buffer)."""
        self.runtime.upload_into(dst, host)

    def graph_memory_bytes(self, graphs, exclude=()) -> int:
        """Bytes the captured graphs hold of their own: the private pool's (cuda), or the
        buffers the recorded graphs hold less the placed weights and the arrays in `exclude`
        (the KV pools, the static inputs; the harness)."""
        exclude = [*exclude, *(dev for _, dev in self._weights.values())]
        return (self.runtime.pool_bytes(self.graph_pool)
                + sum(self.runtime.graph_bytes(g.graph, exclude) for g in graphs))

    def check_model(self, model_config, block_size: int) -> None:
        """Refuse at start-up the shapes the attention kernels do not serve (not mid-step)."""
        head_dim = model_config.head_dim
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise UnsupportedKernelShape(f"head_dim {head_dim}: the {self.name} backend's "
                                         f"attention kernels serve {SUPPORTED_HEAD_DIMS}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise UnsupportedKernelShape(f"block_size {block_size}: the {self.name} backend's "
                                         f"attention kernels serve {SUPPORTED_BLOCK_SIZES}")

    def kv_cache_budget_bytes(self, profile, *, gpu_memory_utilization: float) -> int:
        """KV bytes for the engine. Host memory (the harness): the fixed host budget, as the
        numpy backend's. Device memory: measured around `profile` (ModelRunner.profile_run:
        one maximum-size step of the runner's own model on a scratch KV pool) -- the weights it
        placed and the activation peak -- then kv_cache_budget_bytes(...) of what was measured.

        profile None (a tensor-parallel rank cannot run its shard alone: the collectives need
        every rank) raises on a device: give num_kv_blocks or kv_cache_memory_bytes per rank."""
        runtime = self.runtime
        if runtime.memory_info() is None:
            return DEFAULT_HOST_KV_CACHE_BYTES
        if profile is None:
            raise PagedRunError(f"{self.name}: the KV budget is measured by running the model "
                                "on this GPU, which a tensor-parallel shard cannot do alone; "
                                "give num_kv_blocks (--num-kv-blocks) or "
                                "kv_cache_memory_bytes, per rank")
        runtime.release_cached()
        free_before, total = runtime.memory_info()
        reserved_before = runtime.reserved_bytes()
        weights_before = self.placed_weight_bytes()  # already counted in free_before
        scratch_kv_bytes = profile()
        runtime.synchronize()
        new_weights_bytes = self.placed_weight_bytes() - weights_before
        step_bytes = runtime.reserved_bytes() - reserved_before
        activation_peak = max(0, step_bytes - new_weights_bytes - scratch_kv_bytes)
        runtime.release_cached()  # the scratch pool and activations; the weights stay placed
        return kv_cache_budget_bytes(total, total - free_before, new_weights_bytes,
                                     activation_peak, gpu_memory_utilization)

    def placed_weight_bytes(self) -> int:
        """Bytes of the weights this backend has placed on the device so far."""
        return sum(int(dev.nbytes) for _, dev in self._weights.values())

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device; None on the harness."""
        return self.runtime.memory_info()

    def to_kernel_dtype(self, x: np.ndarray) -> np.ndarray:
        """float32 host values -> host array in the backend dtype (bf16: uint16 bits, RNE)."""
        if self.act_dtype == np.uint16:
            return to_bf16_bits(x)
        return np.ascontiguousarray(x, dtype=self.act_dtype)

    def device(self, host: np.ndarray):
        return self.runtime.upload(np.ascontiguousarray(host))

    def weight(self, w, *, keep_float32: bool = False):
        """The placed, converted copy of a model weight (once per underlying array)."""
        if w is None:
            return None
        key = (w.__array_interface__["data"][0], w.shape, w.strides, keep_float32)
        hit = self._weights.get(key)
        if hit is None:
            host = np.asarray(w, dtype=np.float32)
            host = host if keep_float32 else self.to_kernel_dtype(host)
            # Keep the original alive: its address is the key.
            hit = self._weights[key] = (w, self.device(host))
        return hit[1]

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype)

    def empty_like(self, x):
        return self.xp.empty_like(x)

    def to_host(self, x) -> np.ndarray:
        host = self.runtime.to_host(x)
        if np.dtype(host.dtype) == np.uint16:
            return from_bf16_bits(host)
        return np.asarray(host, dtype=np.float32)

    def to_device(self, host: np.ndarray):
        """A device copy of a host array (numpy under the harness: the array itself if it is
        already contiguous)."""
        return self.device(host)

    def step_inputs(self, positions, slot_mapping, attn) -> StepInputs:
        """The step's metadata uploaded once, for every layer (runtime/backends/step_inputs.py)."""
        return upload_step(self.to_device, positions, slot_mapping, attn,
                           upload_rows=self.to_device)

    def _ints(self, x):
        """Device int32 array: a step input's copy made once per step, a device array as it
        is, else uploaded now."""
        if isinstance(x, DeviceInts):
            return x.device
        if not isinstance(x, np.ndarray) and isinstance(x, self.xp.ndarray):
            return x  # already on the device (cuda: e.g. a masked copy of the token ids)
        return self.device(np.asarray(x, dtype=np.int32))

    @staticmethod
    def _host_ints(x) -> np.ndarray:
        return x.host if isinstance(x, DeviceInts) else np.asarray(x, dtype=np.int32)

    # ------------------------------------------------------------------ ops
    def embedding(self, token_ids, table):
        return fused_ops.embedding(self.module("embedding"), self._ints(token_ids),
                                   self.weight(table))

    def rms_norm(self, x, weight, eps):
        return fused_ops.rms_norm(self.module("norm"), x, self.weight(weight), eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        """Out of place, like numpy_ops: the caller's residual (often a row view) is kept."""
        residual_out = self.xp.empty(x.shape, dtype=np.float32)
        if np.dtype(residual.dtype) != np.float32:
            residual = self._widened(residual)
        return fused_ops.fused_add_rms_norm(self.module("norm"), x, residual, self.weight(weight),
                                            eps, residual_out=residual_out)

    def _widened(self, x):
        """float32 copy of a 16-bit activation (the first layer's residual: the embedding
        output). Array ops, not a kernel: a GPU graph captures them, a sim graph records them
        here as a host step -- else a 16-bit sim replay would reuse the capture's values."""
        return self.runtime.array_op(fused_ops.to_float32, (x,))

    def place_weight(self, host: np.ndarray):
        """A host array placed on the device as it is, counted among the placed weights."""
        dev = self.device(host)
        self._weights[("placed", id(dev))] = (host, dev)
        return dev

    def linear_weight(self, weight):
        """An I4Z matrix (awq / gptq) -> its WeightOnlyMatrix, placed now; another
        QuantizedMatrix dequantized; with quantization "int8" a float [N, K] matrix with
        K % 64 == 0 quantized and placed now; else the float array as it is (placed,
        converted, on the device at its first use by `weight`)."""
        if isinstance(weight, QuantizedMatrix):
            if weight.ggml_type == weight_only.INT4_TYPE:
                return weight_only.pack_int4(weight, self)
            weight = weight.dequantize()
        if self.quantization == "int8" and weight_only.int8_servable(weight):
            return weight_only.pack_int8(weight, self)
        return weight

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        if isinstance(weight, weight_only.WeightOnlyMatrix):
            x = self.xp.ascontiguousarray(x)
            if x.dtype != self.act_dtype:  # not the model's path (its ops emit act_dtype)
                x = self.device(self.to_kernel_dtype(self.to_host(x)))
            return weight_only.linear(self.module("wq"), x, weight, self.weight(bias),
                                      out_dtype=out_dtype)
        # self.weight places a contiguous [out, in] copy: the "nk" layout, skinny-GEMM ready.
        return gemm.linear(self.module("gemm"), self.xp.ascontiguousarray(x), self.weight(weight),
                           self.weight(bias), out_dtype=out_dtype)

    def silu_and_mul(self, gate_up):
        return fused_ops.silu_and_mul(self.module("activation"), gate_up)

    def gelu_tanh_and_mul(self, gate_up):
        return fused_ops.gelu_tanh_and_mul(self.module("activation"), gate_up)

    def scale_activations(self, x, factor: float):
        """x * factor, the factor rounded to the activation dtype first (as transformers rounds
        Gemma's embedding scale to the weights' dtype); host math, once per step."""
        factor32 = float(self.to_host(self.device(self.to_kernel_dtype(np.float32([factor]))))[0])
        return self._on_host(numpy_ops.scale_activations, x, factor=factor32)

    def _on_host(self, op, *arrays, **kwargs):
        """op over host float32 copies of `arrays`, the result placed back in the activation
        dtype: the path of ops with no kernel yet (a round trip per call on cuda)."""
        out = op(*(self.to_host(a) for a in arrays), **kwargs)
        return self.device(self.to_kernel_dtype(out))

    def moe_route(self, router_logits, top_k: int, renormalize: bool):
        """(topk_ids [T, top_k] int32, topk_weights [T, top_k] float32), on the device; the
        router logits may come in the activation dtype (they are widened to float32 first)."""
        logits = self.xp.ascontiguousarray(fused_ops.to_float32(self.xp.asarray(router_logits)))
        return moe.moe_route(self.module("moe"), logits, top_k, renormalize)

    def moe_experts(self, x, topk_ids, topk_weights, w_gate_up, w_down):
        """The routed experts on cuda/moe.cu (grouped GEMMs over expert-sorted pairs). The
        [E, 2I, H] / [E, H, I] float32 expert weights are placed once, like dense weights;
        y comes back in the activation dtype, like `linear`'s output."""
        x = self.xp.ascontiguousarray(x)
        if x.dtype != self.act_dtype:  # not the model's path (its norms emit act_dtype)
            x = self.device(self.to_kernel_dtype(self.to_host(x)))
        ids = self.xp.ascontiguousarray(self.xp.asarray(topk_ids), dtype=np.int32)
        weights = self.xp.ascontiguousarray(self.xp.asarray(topk_weights), dtype=np.float32)
        return moe.moe_experts(self.module("moe"), x, ids, weights, self.weight(w_gate_up),
                               self.weight(w_down))

    def rotary_embedding_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache,
                                         v_cache, slot_mapping):
        return cache_ops.rotary_embedding_and_cache_write(
            self.module("rotary"), q, k, v, self._ints(positions),
            self.weight(cos_sin_cache, keep_float32=True), k_cache, v_cache,
            self._ints(slot_mapping))

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None):
        host_lens = self._host_ints(context_lens)  # the longest context, without a device read
        return attention.paged_decode_attention(
            self.module("decode"), self.xp.ascontiguousarray(q), k_cache, v_cache,
            self._ints(block_tables), self._ints(context_lens), scale,
            max_context_len=int(host_lens.max()) if host_lens.size else 1,
            sliding_window=sliding_window)

    def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, query_start_loc,
                                context_lens, scale, sliding_window=None):
        qsl = self._host_ints(query_start_loc)
        max_query_len = int(np.diff(qsl).max()) if qsl.size > 1 else 0
        return attention.paged_prefill_attention(
            self.module("prefill"), self.xp.ascontiguousarray(q), k_cache, v_cache,
            self._ints(block_tables), self._ints(query_start_loc), self._ints(context_lens),
            scale, max_query_len=max_query_len, sliding_window=sliding_window)

    @property
    def lora_weights(self) -> tuple:
        """Slot stacks in the activation dtype (lora.cu takes x, y, A and B in one dtype)."""
        return self.act_dtype, self.xp

    def lora_batch(self, batch):
        """The step's LoRATilePlan, uploaded once for every layer's shrink and expand."""
        return lora.lora_tile_plan(batch, self.xp)

    def add_lora(self, y, x, lora_a, lora_b, batch, slice_starts):
        """y [T, out] += LoRA(x [T, in]) in place on cuda/lora.cu; `batch`: lora_batch's plan.
        y is `linear`'s fresh contiguous output, so the in-place add is safe."""
        return lora.add_lora(self.module("lora"), y, self.xp.ascontiguousarray(x), lora_a,
                             lora_b, batch, slice_starts)

    def copy_blocks(self, k_caches, v_caches, block_copies) -> None:
        pairs = self._ints(np.asarray(block_copies).reshape(-1, 2))
        cache_ops.copy_blocks(self.module("blocks"), k_caches, v_caches, pairs)

    def swap_blocks(self, src_caches, dst_caches, block_pairs) -> None:
        cache_ops.swap_blocks(self.module("blocks"), src_caches, dst_caches, block_pairs)

    def sampler(self, eos_token_ids, seed: int = 0,
                logprobs_mode: str = "raw_logprobs") -> KernelSampler:
        return KernelSampler(self.module("sampling"), eos_token_ids, seed, xp=self.xp,
                             logprobs_mode=logprobs_mode,
                             download_async=self.runtime.download_async)

    def rejection_sampler(self):
        """Speculative decoding's verification on cuda/rejection_sample.cu: a function with
        spec_decode.rejection_sampler.rejection_sample's arguments (host arrays are copied to
        the device; the result comes back to the host)."""
        from pagedrun.runtime.kernels import rejection

        module = self.module("rejection")

        def sample(target_weights, draft_token_ids, num_draft_tokens, draft_weights, greedy,
                   uniforms):
            xp = self.xp
            return rejection.rejection_sample(
                module, xp.ascontiguousarray(xp.asarray(target_weights, dtype=np.float32)),
                draft_token_ids, num_draft_tokens,
                None if draft_weights is None else xp.ascontiguousarray(
                    xp.asarray(draft_weights, dtype=np.float32)), greedy, uniforms)
        return sample




def kv_cache_budget_bytes(total_bytes: int, used_before_bytes: int, weights_bytes: int,
                          activation_peak_bytes: int, gpu_memory_utilization: float) -> int:
    """utilization x total, minus what was in use before the engine (CUDA context, other
    processes), the weights and the activation peak of a maximum-size step; never negative."""
    budget = (int(gpu_memory_utilization * total_bytes) - used_before_bytes - weights_bytes
              - activation_peak_bytes)
    log.info("GPU memory: %.2f GiB total, utilization %.2f, in use before %.2f GiB, weights "
             "%.2f GiB, step peak %.2f GiB -> KV budget %.2f GiB", total_bytes / 2**30,
             gpu_memory_utilization, used_before_bytes / 2**30, weights_bytes / 2**30,
             activation_peak_bytes / 2**30, max(budget, 0) / 2**30)
    return max(budget, 0)
