"""The dense numpy reference forward of the Llama family: the oracle every other path is tested
against (correctness chain, step 1: it must match Hugging Face transformers in float32).

It is written to be obviously right, not fast: one sequence, float32, a plain contiguous KV
cache, each step of the decoder spelled out in the order transformers applies it:

    x = embed_tokens[token_ids]
    for each layer:
        h = rms_norm(x) ; q, k, v = h @ W.T (+ b)
        (Qwen3) q, k = rms_norm per head (q_norm, k_norm) ; rotate q, k ; append k, v to the cache
        x = x + o_proj(causal grouped-query attention(q, cache))
        x = x + down_proj(silu(gate_proj(rms_norm(x))) * up_proj(rms_norm(x)))
            (mixture-of-experts layers: `moe_block` instead, token by token)
    logits = rms_norm(x) @ lm_head.T

Gemma 3 (config.post_sublayer_norms) in transformers' Gemma3DecoderLayer order:

    x = embed_tokens[token_ids] * embedding_scale
    for each layer:
        x = x + post_attention_layernorm(attention(input_layernorm(x)))   (q/k normed per head)
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    (mlp: down(gelu_tanh(gate) * up); attention scaled by attention_scale, local layers windowed
    and rotated with local_rope_theta; norm weights come folded to (1 + w) from the loader)

The small helpers (`rope_inv_freq`, `rope_cos_sin`, `apply_rotary`, `rms_norm`, `silu`,
`moe_route_token`, `moe_block`) are
public so that kernel tests can reuse the exact same math. The rotary ones are runtime/rope.py's
(the one RoPE implementation, shared with the paged model and numpy_ops), taken per ModelConfig.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .model_config import ModelConfig
from .rope import apply_rotary, model_inv_freq
from .rope import rope_cos_sin as _angles_cos_sin
from .weights import LayerWeights, ModelWeights

# Capacity of a fresh DenseKVCache; it doubles whenever a forward needs more.
INITIAL_KV_CACHE_TOKENS = 64


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies, [head_dim // 2] float64, Llama 3 scaling applied if any
    (runtime/rope.py: the one RoPE implementation, which this forward checks against HF)."""
    return model_inv_freq(config)


def rope_cos_sin(config: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles, each [len(positions), head_dim // 2] float64."""
    return _angles_cos_sin(model_inv_freq(config), positions)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [..., n] float32, weight: [n] -> weight * x / sqrt(mean(x^2) + eps) over the last
    axis (n: hidden, or head_dim for Qwen3's per-head q/k norms)."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (gelu_pytorch_tanh), elementwise, float32."""
    x = x.astype(np.float32, copy=False)
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x ** 3)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), elementwise, same dtype."""
    # exp(-x) overflows to inf for very negative x; x / inf = -0 is the right limit.
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def moe_route_token(router_logits: np.ndarray, top_k: int,
                    renormalize: bool) -> tuple[list[int], list[float]]:
    """One token's experts: router_logits [num_experts] -> (top_k expert ids by decreasing
    probability, lower id first on ties; their float32 softmax probabilities, divided by their
    sum when `renormalize`)."""
    logits = np.asarray(router_logits, dtype=np.float32)
    probs = np.exp(logits - logits.max())
    probs = probs / probs.sum()
    ids = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:top_k]
    weights = [probs[e] for e in ids]
    if renormalize:
        total = np.float32(sum(weights))
        weights = [w / total for w in weights]
    return ids, [float(w) for w in weights]


def moe_block(h: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
              top_k: int, renormalize: bool) -> np.ndarray:
    """A mixture-of-experts MLP, one token at a time (slow and plain on purpose).

    h: [T, hidden] float32; router: [num_experts, hidden]; gate_up: [num_experts, 2 * I, hidden]
    (gate rows, then up rows); down: [num_experts, hidden, I]. Returns [T, hidden] float32:
    sum over the token's experts e of weight_e * down_e(silu(gate_e h) * up_e h).
    """
    inter = gate_up.shape[1] // 2
    out = np.zeros_like(h, dtype=np.float32)
    for t in range(h.shape[0]):
        ids, weights = moe_route_token(router @ h[t], top_k, renormalize)
        for e, weight in zip(ids, weights):
            gate = gate_up[e, :inter] @ h[t]
            up = gate_up[e, inter:] @ h[t]
            out[t] += np.float32(weight) * (down[e] @ (silu(gate) * up))
    return out


class DenseKVCache:
    """Keys and values of one sequence, per layer, contiguous by position (rotated keys).

    keys, values: [num_hidden_layers, capacity, num_key_value_heads, head_dim] float32; the
    first `num_tokens` positions are valid.
    """

    def __init__(self, config: ModelConfig, capacity: int = INITIAL_KV_CACHE_TOKENS) -> None:
        shape = (config.num_hidden_layers, capacity, config.num_key_value_heads, config.head_dim)
        self.keys = np.zeros(shape, dtype=np.float32)
        self.values = np.zeros(shape, dtype=np.float32)
        self.num_tokens = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def reserve(self, num_tokens: int) -> None:
        """Grow (by doubling) so that positions [0, num_tokens) fit."""
        if num_tokens <= self.capacity:
            return
        new_capacity = max(num_tokens, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], new_capacity, *old.shape[2:]), dtype=old.dtype)
            new[:, :old.shape[1]] = old
            setattr(self, name, new)


class ReferenceModel:
    """Dense float32 forward and greedy decoding for one sequence at a time."""

    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        # The oracle computes in float32 only; narrower weights would silently change its numbers.
        if weights.embed_tokens.dtype != np.float32:
            raise ValueError("ReferenceModel needs float32 weights, got "
                             f"{weights.embed_tokens.dtype}")
        self.config = config
        self.weights = weights

    def forward(
        self,
        token_ids: np.ndarray | Sequence[int],
        start_pos: int = 0,
        kv_cache: DenseKVCache | None = None,
    ) -> np.ndarray:
        """Logits [T, vocab_size] float32 for token_ids [T] at positions start_pos .. start_pos+T-1.

        With `kv_cache`, the tokens attend to the cached positions [0, start_pos) as well, and
        their keys/values are written at [start_pos, start_pos + T) (start_pos may rewind the
        cache: later positions are dropped). Without one, they attend only to each other.
        """
        hidden = self.hidden_states(token_ids, start_pos, kv_cache)
        return hidden @ self.weights.lm_head.T

    def hidden_states(
        self,
        token_ids: np.ndarray | Sequence[int],
        start_pos: int = 0,
        kv_cache: DenseKVCache | None = None,
    ) -> np.ndarray:
        """Final-norm hidden states [T, hidden_size] float32 (what `forward` multiplies by
        lm_head)."""
        config = self.config
        token_ids = np.asarray(token_ids)
        if (token_ids.ndim != 1 or token_ids.size == 0
                or not np.issubdtype(token_ids.dtype, np.integer)):
            raise ValueError(f"token_ids must be a non-empty 1-D integer array, got {token_ids!r}")
        if token_ids.min() < 0 or token_ids.max() >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size})")
        if start_pos < 0 or (kv_cache is not None and start_pos > kv_cache.num_tokens):
            cached = None if kv_cache is None else kv_cache.num_tokens
            raise ValueError(
                f"start_pos {start_pos} is negative or past the cache's {cached} tokens")

        num_tokens = token_ids.shape[0]
        positions = np.arange(start_pos, start_pos + num_tokens)
        if kv_cache is not None:
            kv_cache.reserve(start_pos + num_tokens)

        x = self.weights.embed_tokens[token_ids].astype(np.float32)
        if config.embedding_scale is not None:
            x = x * np.float32(config.embedding_scale)
        eps = config.rms_norm_eps
        for layer_index, layer in enumerate(self.weights.layers):
            cos, sin = _angles_cos_sin(model_inv_freq(config, layer_index), positions)
            if config.post_sublayer_norms:  # Gemma 3
                h = rms_norm(x, layer.input_layernorm, eps)
                a = self._attention(layer_index, layer, h, positions, cos, sin, kv_cache)
                x = x + rms_norm(a, layer.post_attention_layernorm, eps)
                h = rms_norm(x, layer.pre_feedforward_layernorm, eps)
                act = gelu_tanh if config.hidden_activation != "silu" else silu
                m = (act(h @ layer.gate_proj.T) * (h @ layer.up_proj.T)) @ layer.down_proj.T
                x = x + rms_norm(m, layer.post_feedforward_layernorm, eps)
                continue
            h = rms_norm(x, layer.input_layernorm, config.rms_norm_eps)
            x = x + self._attention(layer_index, layer, h, positions, cos, sin, kv_cache)
            h = rms_norm(x, layer.post_attention_layernorm, config.rms_norm_eps)
            if config.is_moe_layer(layer_index):
                x = x + moe_block(h, layer.router, layer.experts_gate_up, layer.experts_down,
                                  config.num_experts_per_tok, config.norm_topk_prob)
            else:
                x = x + (silu(h @ layer.gate_proj.T) * (h @ layer.up_proj.T)) @ layer.down_proj.T
        if kv_cache is not None:
            kv_cache.num_tokens = start_pos + num_tokens
        return rms_norm(x, self.weights.norm, config.rms_norm_eps)

    def _attention(
        self,
        layer_index: int,
        layer: LayerWeights,
        h: np.ndarray,            # [T, hidden_size] float32, normed
        positions: np.ndarray,    # [T] int, absolute positions of the T tokens
        cos: np.ndarray,          # [T, head_dim // 2] float64
        sin: np.ndarray,          # [T, head_dim // 2] float64
        kv_cache: DenseKVCache | None,
    ) -> np.ndarray:              # [T, hidden_size] float32, after o_proj
        config = self.config
        num_tokens = h.shape[0]
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.head_dim
        q = _linear(h, layer.q_proj, layer.q_bias).reshape(num_tokens, num_heads, head_dim)
        k = _linear(h, layer.k_proj, layer.k_bias).reshape(num_tokens, num_kv_heads, head_dim)
        v = _linear(h, layer.v_proj, layer.v_bias).reshape(num_tokens, num_kv_heads, head_dim)
        if config.qk_norm:
            # rms_norm over the last axis: each head of each token on its own.
            q = rms_norm(q, layer.q_norm, config.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, config.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        start_pos = int(positions[0])
        if kv_cache is not None:
            end_pos = start_pos + num_tokens
            kv_cache.keys[layer_index, start_pos:end_pos] = k
            kv_cache.values[layer_index, start_pos:end_pos] = v
            keys = kv_cache.keys[layer_index, :end_pos]      # [S, num_kv_heads, head_dim]
            values = kv_cache.values[layer_index, :end_pos]
            key_positions = np.arange(end_pos)
        else:
            keys, values, key_positions = k, v, positions

        # Query head j uses kv head j // num_queries_per_kv (transformers' repeat_kv order).
        group = config.num_queries_per_kv
        q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        keys_t = keys.transpose(1, 2, 0)[:, None]            # [num_kv_heads, 1, head_dim, S]
        values_h = values.transpose(1, 0, 2)[:, None]        # [num_kv_heads, 1, S, head_dim]
        scores = (q_grouped @ keys_t) * np.float32(config.softmax_scale)  # [kv, group, T, S]

        visible = key_positions[None, :] <= positions[:, None]        # [T, S] causal
        window = config.layer_sliding_window(layer_index)
        if window is not None:
            visible &= key_positions[None, :] > positions[:, None] - window
        scores = np.where(visible, scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        context = (probs @ values_h).transpose(2, 0, 1, 3).reshape(num_tokens, num_heads * head_dim)
        return _linear(context.astype(np.float32, copy=False), layer.o_proj, layer.o_bias)

    def greedy_generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Greedy (argmax, lowest id on ties) continuation of prompt_ids: the new tokens only.

        Stops after max_new_tokens, or right after emitting a token in eos_token_ids (that
        token is included, as transformers' generate does).
        """
        prompt_ids = np.asarray(prompt_ids)
        cache = DenseKVCache(self.config, capacity=max(len(prompt_ids) + max_new_tokens, 1))
        stop_ids = set(int(t) for t in eos_token_ids)
        new_ids: list[int] = []
        next_input = prompt_ids
        while len(new_ids) < max_new_tokens:
            hidden = self.hidden_states(next_input, cache.num_tokens, cache)
            logits = hidden[-1] @ self.weights.lm_head.T
            token = int(np.argmax(logits))
            new_ids.append(token)
            if token in stop_ids:
                break
            next_input = np.array([token])
        return new_ids


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x: [T, in] @ weight: [out, in].T (+ bias: [out]) -> [T, out]."""
    y = x @ weight.T
    return y if bias is None else y + bias
