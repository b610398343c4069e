"""Llama-family forward (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Mixtral, Qwen3-MoE, Gemma 3)
over a paged KV cache, written against backend ops.

One step runs every scheduled token of every request at once: each weight is one GEMM over all
`num_tokens` rows; only attention looks at requests separately, and it is split into decode rows
(query_len 1, one kernel) and prefill rows (chunks, prefix hits; another kernel).

Weights are fused at load: q/k/v into one [q_size + 2 * kv_size, hidden] matrix, gate/up into
one [2 * intermediate, hidden] matrix, so a layer runs four GEMMs. Each matrix is built float32,
C-contiguous and pre-transposed ([in, out], for `x @ W`), and handed to the backend as the HF
[out, in] layout, the free `.T` view of that storage: the model keeps what `ops.linear_weight`
returns for it (numpy and the kernel backends: the view itself; the compiled cpu backends:
their packed copy, so the float32 matrix is freed).

What form a GEMM weight takes is the LinearMethod's business (runtime/quantization/, looked up by
the backend's quantization name): the model builds each fused weight with
`linear_method.create_weights(ops, *parts)`, multiplies with `linear_method.apply`, and looks
the embedding up with `linear_method.embed`; it names no weight format.

Qwen3's QK-norm (config.qk_norm) is the backend's plain `rms_norm` over a [num_tokens * heads,
head_dim] view of q and of k, between the QKV GEMM and the rotary op: no op of its own, so it
runs unchanged on every backend.

Mixture-of-experts layers (config.moe_layers: Mixtral's all, Qwen3-MoE's per decoder_sparse_step
and mlp_only_layers) run runtime/models/moe.py's `MoeBlock` in place of the dense MLP; the rest of
the layer is the same code.

Gemma 3 is config fields too: embeddings times `embedding_scale`, the attention and MLP outputs
normed (`attn_out_norm`, `mlp_out_norm`) before the fused add-norm takes them into the residual
stream, GeGLU (`ops.gelu_tanh_and_mul`), `softmax_scale`, and per layer a sliding window and a
rotary table (local layers have their own base). The (1 + w) norms come folded from the loader.

Multi-LoRA (`forward(..., lora=)`, runtime/lora/): right after each of the four GEMMs, the step's
adapters add their low-rank deltas to the GEMM's fresh output, in place: y += B_slot (A_slot x)
for the tokens whose request has an adapter slot (`ops.add_lora`, one shrink/expand pair per
adapter present, none at all in a step without adapters). The o_proj and down_proj deltas are
added before the all-reduce, so under tensor parallelism they are partial sums like the base
output (the adapter's A is sharded by input features there). MoE layers have no dense MLP
targets (the weight stack returns None for them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.moe import MoeBlock
from pagedrun.runtime.models.tensor_parallel import SINGLE_DEVICE
from pagedrun.runtime.quantization import linear_method_for
from pagedrun.runtime.rope import build_cos_sin_cache, model_inv_freq
from pagedrun.runtime.weights import ModelWeights

# The four LoRA targets, by the fused GEMM they ride on (runtime/lora/adapter_weights.py).
LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN = "qkv", "o", "gate_up", "down"


@dataclass
class AttentionInputs:
    """One step's attention metadata, split by kind of row.

    Token rows are given as slices when a kind's rows are contiguous in the batch (the usual
    case: running decodes first, then prefills), else as int64 index arrays.
    """

    decode_token_rows: slice | np.ndarray    # rows of q for decode requests
    decode_block_tables: np.ndarray          # [num_decode, max_blocks] int32
    decode_context_lens: np.ndarray          # [num_decode] int32
    prefill_token_rows: slice | np.ndarray   # rows of q for prefill requests
    prefill_block_tables: np.ndarray         # [num_prefill, max_blocks] int32
    prefill_query_start_loc: np.ndarray      # [num_prefill + 1] int32, relative to prefill rows
    prefill_context_lens: np.ndarray         # [num_prefill] int32
    num_decode: int
    num_prefill: int


@dataclass
class _Layer:
    input_norm: np.ndarray     # [hidden]
    # The GEMM weights as ops.linear_weight returned them for the HF [out, in] matrices:
    qkv: object                # [q_size + 2 * kv_size, hidden]
    qkv_bias: np.ndarray | None
    o: object                  # [hidden, q_size]
    o_bias: np.ndarray | None
    post_norm: np.ndarray      # [hidden]
    gate_up: object | None     # [2 * intermediate, hidden]; None in a MoE layer
    down: object | None        # [hidden, intermediate]
    q_norm: np.ndarray | None  # [head_dim] when config.qk_norm, else None
    k_norm: np.ndarray | None  # [head_dim]
    moe: MoeBlock | None = None   # config.is_moe_layer: the experts replace the dense MLP
    # config.post_sublayer_norms (Gemma 3): norms of the attention and MLP outputs, applied
    # before they join the residual stream; None elsewhere.
    attn_out_norm: np.ndarray | None = None  # [hidden]
    mlp_out_norm: np.ndarray | None = None   # [hidden]
    # The window this layer attends within (None: full causal attention) and its
    # [max_position, head_dim] rotary table (shared between layers with the same base).
    sliding_window: int | None = None
    cos_sin_cache: np.ndarray | None = None


def _f32(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(x, dtype=np.float32)


class LlamaModel:
    """The decoder stack and the LM head; stateless apart from weights (the KV cache is passed
    in)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, ops, max_position: int,
                 first_layer: int = 0, tp=SINGLE_DEVICE) -> None:
        """first_layer: the model-wide index of weights.layers[0] (a pipeline stage holds
        layers first_layer .. first_layer + len - 1; rope bases, sliding windows and MoE layers
        are looked up by that index). A stage without the embedding or the LM head has
        weights.embed_tokens / weights.lm_head None (runtime/distributed/pipeline.py).
        tp: the rank's tensor parallelism (runtime/models/tensor_parallel.py); config and
        weights are then the rank's shard (runtime/distributed/sharding.py)."""
        self.config = config
        self.ops = ops
        self.first_layer = first_layer
        self.tp = tp
        # How the GEMM weights are held and multiplied (runtime/quantization/).
        self.linear_method = method = linear_method_for(ops)
        # x @ weight.T (+ bias) as the weight's method multiplies, and the sum over tensor-parallel
        # ranks (one rank: x itself), bound once here: ops.linear / the rank's all_reduce called
        # straight from the forward, not through a method per GEMM (bench_host_overhead's
        # "launches" row paid 2-6% for that wrapper).
        self._linear = method.bind(ops)
        self.all_reduce = tp.all_reduce
        # A table kept in blocks stays so: embed() dequantizes the rows a step reads.
        self.embed_tokens = tp.embedding_table(method.embedding_table(weights.embed_tokens))
        # [max_position, head_dim] float32 rows [cos | sin]: the reference's float64 angles
        # (runtime/rope.py), so the paged forward rotates exactly as the reference does. Gemma 3's
        # local layers have their own base: one table per distinct base.
        tables: dict[bytes, np.ndarray] = {}
        self.layers = []
        for index, lw in enumerate(weights.layers, start=first_layer):
            inv_freq = model_inv_freq(config, index)
            if inv_freq.tobytes() not in tables:
                tables[inv_freq.tobytes()] = build_cos_sin_cache(inv_freq, max_position)
            sandwich = config.post_sublayer_norms
            if sandwich and (lw.pre_feedforward_layernorm is None
                             or lw.post_feedforward_layernorm is None):
                raise ValueError(f"{config.architecture}: feed-forward norm weights missing")
            moe = config.is_moe_layer(index)
            if config.qk_norm and (lw.q_norm is None or lw.k_norm is None):
                # A loader that forgot them would silently run a different model.
                raise ValueError(f"{config.architecture}: q_norm / k_norm weights missing")
            qkv_bias = None
            if lw.q_bias is not None:
                qkv_bias = _f32(np.concatenate([lw.q_bias, lw.k_bias, lw.v_bias]))
            self.layers.append(_Layer(
                input_norm=_f32(lw.input_layernorm),
                qkv=method.create_weights(ops, lw.q_proj, lw.k_proj, lw.v_proj),
                qkv_bias=qkv_bias,
                o=method.create_weights(ops, lw.o_proj),
                o_bias=_f32(lw.o_bias),
                post_norm=_f32(lw.pre_feedforward_layernorm if sandwich
                               else lw.post_attention_layernorm),
                gate_up=None if moe else method.create_weights(ops, lw.gate_proj, lw.up_proj),
                down=None if moe else method.create_weights(ops, lw.down_proj),
                q_norm=_f32(lw.q_norm) if config.qk_norm else None,
                k_norm=_f32(lw.k_norm) if config.qk_norm else None,
                moe=MoeBlock.from_weights(lw, config) if moe else None,
                attn_out_norm=_f32(lw.post_attention_layernorm) if sandwich else None,
                mlp_out_norm=_f32(lw.post_feedforward_layernorm) if sandwich else None,
                sliding_window=config.layer_sliding_window(index) if config.layer_types else None,
                cos_sin_cache=tables[inv_freq.tobytes()],
            ))
        self.norm = _f32(weights.norm)
        self.lm_head = (None if weights.lm_head is None
                        else method.create_weights(ops, weights.lm_head))  # [vocab, hidden]
        self.cos_sin_cache = self.layers[0].cos_sin_cache if self.layers else (
            build_cos_sin_cache(model_inv_freq(config), max_position))
        self.scale = config.softmax_scale
        # SwiGLU, or Gemma's GeGLU (gelu_pytorch_tanh): the backend op of the activation.
        self.act_and_mul = (ops.silu_and_mul if config.hidden_activation == "silu"
                            else ops.gelu_tanh_and_mul)
        # A backend's compiled pure-decode step (the compiled cpu backends: all layers in
        # one call, the per-op path's bits), or None. Not under tensor parallelism (the loop runs no
        # collective) nor for subclasses. `forward` takes it per step where it applies.
        self.decode_loop = (ops.make_decode_loop(self) if ops.capabilities.decode_loop
                            and type(self) is LlamaModel and tp.single_device else None)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                attn: AttentionInputs, k_caches: list[np.ndarray], v_caches: list[np.ndarray],
                lora=None, hidden: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Run the decoder over one step's tokens, writing their K/V into the paged cache.

        token_ids, positions, slot_mapping: [num_tokens] int32
        k_caches, v_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim] float32
        Returns (x, residual), each [num_tokens, hidden] float32: the last layer's output and the
        residual stream, still to be added and normed (only sampled rows need that, see `logits`).
        lora: None, or the step's adapters: `.stack` (a LoRAWeightStack: per layer and target
        the slot weights) and `.batch` (the backend's `lora_batch` of the step's tokens grouped
        by slot); the model runner passes None when no token of the step has an adapter.
        hidden: a later pipeline stage's input, the previous stage's (x, residual); the
        embedding is skipped (token_ids still give the step's length).
        A pure-decode step without LoRA or `hidden` runs all layers in one call of
        `self.decode_loop` when the backend made one (the same results, bit for bit).
        """
        ops, cfg = self.ops, self.config
        num_tokens = token_ids.shape[0]
        q_size, kv_size = cfg.q_size, cfg.kv_size
        if hidden is not None:
            x, residual = hidden
        else:
            x = self.embed(token_ids)
            if cfg.embedding_scale is not None:
                # Gemma: the lookup times sqrt(hidden) (the tied LM head keeps the unscaled
                # table).
                x = ops.scale_activations(x, cfg.embedding_scale)
            residual = None
            if (self.decode_loop is not None and lora is None and attn.num_prefill == 0
                    and attn.num_decode == num_tokens):
                return self.decode_loop(x, positions, slot_mapping, attn.decode_block_tables,
                                        attn.decode_context_lens, k_caches, v_caches)
        for index, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            if residual is None:
                residual = x
                h = ops.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            else:
                h, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm,
                                                     cfg.rms_norm_eps)
            qkv = self._lora(lora, index, LORA_QKV, self._linear(h, layer.qkv, layer.qkv_bias),
                             h)
            q = qkv[:, :q_size].reshape(num_tokens, cfg.num_attention_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, cfg.num_key_value_heads,
                                                        cfg.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = self._head_norm(q, layer.q_norm)
                k = self._head_norm(k, layer.k_norm)
            q, _ = ops.rotary_embedding_and_cache_write(q, k, v, positions, layer.cos_sin_cache,
                                                        k_cache, v_cache, slot_mapping)
            attn_out = self._attention(q, k_cache, v_cache, attn, layer.sliding_window)
            o_in = attn_out.reshape(num_tokens, q_size)
            x = self.all_reduce(self._lora(lora, index, LORA_O,
                                           self._linear(o_in, layer.o, layer.o_bias), o_in))
            if layer.attn_out_norm is not None:
                x = ops.rms_norm(x, layer.attn_out_norm, cfg.rms_norm_eps)
            h, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            if layer.moe is not None:
                mlp_out = layer.moe(ops, h)
            else:
                gate_up = self._lora(lora, index, LORA_GATE_UP,
                                     self._linear(h, layer.gate_up), h)
                act = self.act_and_mul(gate_up)
                mlp_out = self._lora(lora, index, LORA_DOWN, self._linear(act, layer.down), act)
            x = self.all_reduce(mlp_out)
            if layer.mlp_out_norm is not None:
                x = ops.rms_norm(x, layer.mlp_out_norm, cfg.rms_norm_eps)
        return x, residual

    @property
    def input_permuted(self) -> bool:
        """Whether any projection gathers its inputs on the host first: the decode graphs of
        the sim harness would not record that gather."""
        return any(self.linear_method.gathers_inputs(w) for layer in self.layers
                   for w in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def graph_capture_refusal(self) -> str | None:
        """Why this model's decode forward cannot be captured in a device graph
        (runtime/decode_graphs.py), or None when it can: the steps that leave the device
        mid-forward or that a captured replay would not repeat."""
        if self.input_permuted:
            # x[:, perm] is an array-module gather, not a launch the sim's recording replays.
            return "act-order (desc_act) weights gather their inputs outside the kernels"
        if any(layer.moe is not None for layer in self.layers):
            return "mixture-of-experts routing sizes its expert GEMMs on the host"
        if self.config.embedding_scale is not None:
            return "the embedding scale runs on the host"
        if self.config.sliding_window is not None or any(
                layer.sliding_window is not None for layer in self.layers):
            return "sliding-window layers"
        return None

    def _lora(self, lora, index: int, target: str, y, x):
        """y (a GEMM's fresh [num_tokens, out] output) plus the step's LoRA deltas of layer
        `index`'s `target` for input x [num_tokens, in]; y itself without adapters."""
        if lora is None:
            return y
        module = lora.stack.module(index, target)
        if module is None:  # an MoE layer's experts: no LoRA
            return y
        lora_a, lora_b, slice_starts = module
        return self.ops.add_lora(y, x, lora_a, lora_b, lora.batch, slice_starts)

    def _head_norm(self, x, weight: np.ndarray):
        """RMSNorm of every head: x [num_tokens, heads, head_dim] (a strided view of qkv) ->
        a new contiguous array of that shape, normed over head_dim with weight [head_dim]."""
        rows = self.ops.xp.ascontiguousarray(x).reshape(-1, x.shape[-1])
        return self.ops.rms_norm(rows, weight, self.config.rms_norm_eps).reshape(x.shape)

    # Where tensor-parallel ranks meet (self.tp, runtime/distributed/tensor_parallel.py): a
    # rank's embedding is a masked lookup into its vocabulary slice, the row-parallel o_proj /
    # down_proj (or experts') outputs are partial sums to all-reduce, and its LM head logits are
    # gathered to rank 0. One device: SINGLE_DEVICE, the identity.
    def embed(self, token_ids: np.ndarray):
        """token_ids: [num_tokens] int32 -> [num_tokens, hidden] activations."""
        ids = self.tp.local_token_ids(token_ids)
        return self.tp.all_reduce(self.linear_method.embed(self.ops, ids, self.embed_tokens))

    def _attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   attn: AttentionInputs, sliding_window: int | None = None) -> np.ndarray:
        """q: [num_tokens, num_heads, head_dim] rotated. Returns the same shape. With
        `sliding_window` (Gemma 3's local layers) a query at position i sees only keys
        j > i - sliding_window; the cache still holds every position (nothing is evicted)."""
        ops = self.ops
        window = {} if sliding_window is None else {"sliding_window": sliding_window}
        if attn.num_prefill == 0:
            return ops.paged_decode_attention(q, k_cache, v_cache, attn.decode_block_tables,
                                              attn.decode_context_lens, self.scale, **window)
        if attn.num_decode == 0:
            return ops.paged_prefill_attention(q, k_cache, v_cache, attn.prefill_block_tables,
                                               attn.prefill_query_start_loc,
                                               attn.prefill_context_lens, self.scale, **window)
        out = ops.empty_like(q)  # the backend's array and dtype
        out[attn.decode_token_rows] = ops.paged_decode_attention(
            q[attn.decode_token_rows], k_cache, v_cache, attn.decode_block_tables,
            attn.decode_context_lens, self.scale, **window)
        out[attn.prefill_token_rows] = ops.paged_prefill_attention(
            q[attn.prefill_token_rows], k_cache, v_cache, attn.prefill_block_tables,
            attn.prefill_query_start_loc, attn.prefill_context_lens, self.scale, **window)
        return out

    def logits(self, x: np.ndarray, residual: np.ndarray) -> np.ndarray:
        """Final norm and LM head for the given rows: [rows, hidden] x2 -> [rows, vocab] float32."""
        h, _ = self.ops.fused_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        return self.tp.gather_logits(
            self.linear_method.apply(self.ops, h, self.lm_head, out_dtype=np.float32))
