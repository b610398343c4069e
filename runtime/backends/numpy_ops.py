"""numpy backend: the CPU ops of the paged forward, and the reference every CUDA kernel is tested
against.

Each op takes exactly what its kernel takes: the same arguments, the same KV cache layout, the
same `slot_mapping` / `block_tables` conventions as the scheduler's `SchedulerOutput`.

KV cache layout (NHD, one K and one V array per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s lives at (block s // block_size, offset s % block_size).
    block_tables[i, j] is the physical block of request i's logical block j; rows are padded
    with 0 past the request's last block (padding entries are never dereferenced).

Numerics: math in float32 (softmax with max subtraction, sums in float32). Inputs may be float32
or float16; outputs have float16 dtype when the main input is float16, else float32. numpy has no
bfloat16: the bf16 path is represented as float32 arrays holding bf16 values; `round_to_bf16`
rounds (RNE) where a bf16 kernel stores.

GQA: query head h reads kv head h // (num_heads // num_kv_heads).

KV cache dtype: float32 (or float16), or uint16 holding bf16 bits (EngineConfig.kv_cache_dtype
"bfloat16" on the cpu backends): the cache write rounds k and v to bf16 (`to_bf16_bits`, RNE),
the attention ops widen only the blocks they gather (`from_bf16_bits`, exact) and compute in
float32. Or uint8 holding fp8 e4m3 bits (kv_cache_dtype "fp8", vLLM's name; OCP e4m3: 1 sign,
4 exponent bits biased by 7, 3 mantissa bits, subnormals, no infinities, 0x7F / 0xFF NaN, largest
finite 448): the write rounds to nearest even and saturates to +-448 (`to_fp8_e4m3_bits`,
NVIDIA's __NV_SATFINITE conversion, the one vLLM's fp8 cache uses), the read widens exactly
(`from_fp8_e4m3_bits`). The per-tensor scale is 1.0 -- vLLM's default when a checkpoint carries
no k_scale / v_scale --, so values are stored as they are; no calibration. copy_blocks /
swap_blocks move elements of any dtype.
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.rope import apply_rotary, build_cos_sin_cache, rope_inv_freq  # noqa: F401
from pagedrun.runtime.weights import from_bf16_bits, to_bf16_bits

# Query rows handled per matmul in the attention ops: bounds the score matrix to
# num_heads * QUERY_CHUNK_TOKENS * context_len floats, so a long prefill does not allocate
# gigabytes for scores at once.
QUERY_CHUNK_TOKENS = 256
# The tanh approximation of GELU: sqrt(2 / pi) and the cubic term's coefficient.
GELU_TANH_SQRT_2_OVER_PI = 0.7978845608028654
GELU_TANH_CUBIC = 0.044715


# --------------------------------------------------------------------------------- dtypes

def _f32(x: np.ndarray) -> np.ndarray:
    """float32 view/copy for computing (no copy when already float32)."""
    return np.asarray(x, dtype=np.float32)


def _out_dtype(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float16) if np.asarray(x).dtype == np.float16 else np.dtype(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (round half to even); returns float32.

    NaN stays a quiet NaN (sign kept), +-inf stays inf, finite values past the bf16 max overflow
    to inf as a bf16 store does: weights.to_bf16_bits' rules, the one bf16 rounding.
    """
    return from_bf16_bits(to_bf16_bits(x))


# --------------------------------------------------------------------------------- rotary

# The frequencies, the cos/sin table and the rotation are runtime/rope.py's (one implementation,
# shared with the reference forward and the paged model); re-exported here for the kernel tests.
# rope_inv_freq(head_dim, theta, rope_scaling) -> [head_dim // 2]; build_cos_sin_cache(inv_freq,
# max_position) -> [max_position, head_dim] float32 rows [cos | sin].


def rotary_embedding_and_cache_write(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    cos_sin_cache: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot_mapping: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Rotate q and k by their positions, write rotated k and raw v into the paged cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    positions: [num_tokens] int32, each in [0, max_position), padding tokens included (their
        rotation is computed and discarded, so give them a valid position such as 0)
    cos_sin_cache: [max_position, head_dim] float32 (see `build_cos_sin_cache`)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: [num_tokens] int32; a negative slot is padding: nothing is written for that
        token (its q/k are still rotated and returned).
    Returns (q_rot [num_tokens, num_heads, head_dim], k_rot [num_tokens, num_kv_heads, head_dim]).
    """
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: token counts/shapes differ")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} != head_dim {head_dim}")
    positions = np.asarray(positions)
    slot_mapping = np.asarray(slot_mapping)
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError("positions and slot_mapping must be [num_tokens]")
    if num_tokens and (positions.min() < 0 or positions.max() >= cos_sin_cache.shape[0]):
        raise ValueError("positions out of range of cos_sin_cache")
    half = head_dim // 2
    table = _f32(cos_sin_cache)[positions]
    cos, sin = table[:, :half], table[:, half:]
    q_rot = apply_rotary(_f32(q), cos, sin).astype(_out_dtype(q))
    k_rot = apply_rotary(_f32(k), cos, sin).astype(_out_dtype(k))

    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].astype(np.int64)
    if slots.size:
        if slots.max() >= num_blocks * block_size:
            raise ValueError(f"slot {slots.max()} out of range of {num_blocks}x{block_size} cache")
        if np.unique(slots).size != slots.size:
            raise ValueError("slot_mapping writes the same slot twice in one step")
    blocks, offsets = slots // block_size, slots % block_size
    _store_kv(k_cache, blocks, offsets, k_rot[valid])  # bf16 / fp8 bits: rounded once
    _store_kv(v_cache, blocks, offsets, v[valid])
    return q_rot, k_rot


# --------------------------------------------------------------------------------- fp8 e4m3

FP8_E4M3_MAX = 448.0


def _fp8_e4m3_values() -> np.ndarray:
    """The 256 e4m3 codes as float32 (exact): exponent field 0 is m * 2^-9 (subnormals), else
    (1 + m / 8) * 2^(e - 7); magnitude bits 0x7F are NaN."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 15, codes & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))
    mag[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


_FP8_E4M3_VALUES = _fp8_e4m3_values()


def to_fp8_e4m3_bits(x) -> np.ndarray:
    """float32 values -> uint8 fp8 e4m3 bits: round to nearest, ties to even, saturating to
    +-448 (infinities too); NaN -> 0x7F with its sign; -0 and values that round to 0 keep their
    sign. Its C++ twin is kv_f32_to_fp8 in pyx/cpu_ops_kernels.h (the same integer steps)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    mag = bits & np.uint32(0x7FFFFFFF)
    # |x| >= 2^-6 (float32 exponent >= 121): an e4m3 normal. RNE of the 23-bit mantissa to 3
    # bits (a carry bumps the exponent), exponent rebiased 127 -> 7, saturated at code 0x7E.
    normal = (mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    normal = np.minimum(normal.astype(np.int64) - (120 << 3), 0x7E)
    # Below 2^-6: multiples of 2^-9. |x| * 512 is exact and np.rint rounds half to even (the
    # magnitude is clamped to 2^-6 first, so the other lanes stay finite).
    small = np.minimum(mag, np.uint32(0x3C800000)).view(np.float32) * np.float32(512)
    code = np.where(mag >= np.uint32(0x3C800000), normal, np.rint(small).astype(np.int64))
    code = np.where(mag > np.uint32(0x7F800000), 0x7F, code)
    return (code | sign).astype(np.uint8)


def from_fp8_e4m3_bits(bits: np.ndarray) -> np.ndarray:
    """uint8 fp8 e4m3 bits -> float32 values (exact; 0x7F / 0xFF NaN)."""
    return _FP8_E4M3_VALUES[np.asarray(bits, dtype=np.uint8)]


def _store_kv(cache: np.ndarray, blocks: np.ndarray, offsets: np.ndarray, values) -> None:
    """values written into cache's slots in its element type: bf16 bits (RNE), fp8 e4m3 bits
    (RNE, saturated), or as they are."""
    if cache.dtype == np.uint16:
        values = to_bf16_bits(_f32(values))
    elif cache.dtype == np.uint8:
        values = to_fp8_e4m3_bits(_f32(values))
    cache[blocks, offsets] = values


def widen_kv(cache_elements: np.ndarray) -> np.ndarray:
    """KV cache elements as float32: bf16 (uint16) or fp8 e4m3 (uint8) bits widened exactly."""
    if cache_elements.dtype == np.uint16:
        return from_bf16_bits(cache_elements)
    if cache_elements.dtype == np.uint8:
        return from_fp8_e4m3_bits(cache_elements)
    return _f32(cache_elements)


# --------------------------------------------------------------------------------- attention

def _check_block_ids(block_ids: np.ndarray, num_blocks: int, what: str) -> None:
    """numpy would wrap a negative id silently; a kernel would read out of bounds. Refuse both."""
    if block_ids.size and (block_ids.min() < 0 or block_ids.max() >= num_blocks):
        raise ValueError(f"{what}: block id out of range [0, {num_blocks})")


def _gather_context(cache: np.ndarray, block_table_row: np.ndarray, context_len: int) -> np.ndarray:
    """K or V of the first context_len tokens of one request, [context_len, num_kv_heads, head_dim]
    f32 (a uint16 cache's bf16 bits or a uint8 cache's fp8 bits widened, the gathered rows
    only).

    Only slots < context_len are touched: the padding of the block table and the tail of the
    last block are never read.
    """
    block_size = cache.shape[1]
    if context_len > block_table_row.shape[0] * block_size:
        raise ValueError(f"context_len {context_len} exceeds block table capacity "
                         f"{block_table_row.shape[0]} x {block_size}")
    token_pos = np.arange(context_len)
    blocks = block_table_row[token_pos // block_size].astype(np.int64)
    _check_block_ids(blocks, cache.shape[0], "block_tables")
    return widen_kv(cache[blocks, token_pos % block_size])


def _attend(q_rows: np.ndarray, k_ctx: np.ndarray, v_ctx: np.ndarray, first_query_pos: int,
            scale: float, sliding_window: int | None = None) -> np.ndarray:
    """Causal attention of one request's query rows over its gathered context.

    q_rows: [query_len, num_heads, head_dim] f32; k_ctx, v_ctx: [context_len, num_kv_heads,
    head_dim] f32. Query row j sits at position first_query_pos + j and sees context positions
    <= it (and, with sliding_window, > it - sliding_window). Returns [query_len, num_heads,
    head_dim] f32.
    """
    query_len, num_heads, head_dim = q_rows.shape
    context_len, num_kv_heads = k_ctx.shape[:2]
    group = num_heads // num_kv_heads
    # [num_kv_heads, group, query_len, head_dim]: the heads sharing one kv head batch together.
    q_grouped = q_rows.reshape(query_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    k_t = k_ctx.transpose(1, 2, 0)  # [num_kv_heads, head_dim, context_len]
    v_g = v_ctx.transpose(1, 0, 2)  # [num_kv_heads, context_len, head_dim]
    out = np.empty((num_kv_heads, group, query_len, head_dim), dtype=np.float32)
    context_pos = np.arange(context_len)
    for start in range(0, query_len, QUERY_CHUNK_TOKENS):
        stop = min(query_len, start + QUERY_CHUNK_TOKENS)
        rows = stop - start
        # Keys past the chunk's last query position are invisible to all its rows: skip them.
        num_visible = first_query_pos + stop
        q_chunk = q_grouped[:, :, start:stop].reshape(num_kv_heads, group * rows, head_dim)
        scores = (q_chunk @ k_t[:, :, :num_visible]).reshape(num_kv_heads, group, rows, num_visible)
        scores *= np.float32(scale)
        query_pos = first_query_pos + np.arange(start, stop)
        visible = context_pos[None, :num_visible] <= query_pos[:, None]  # [rows, num_visible]
        if sliding_window is not None:
            visible &= context_pos[None, :num_visible] > query_pos[:, None] - sliding_window
        scores = np.where(visible, scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[:, :, start:stop] = (
            probs.reshape(num_kv_heads, group * rows, num_visible) @ v_g[:, :num_visible]
        ).reshape(num_kv_heads, group, rows, head_dim)
    return out.transpose(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)


def _check_attention_shapes(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    num_heads, head_dim = q.shape[1:]
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape}: expected equal "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")


def paged_decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
) -> np.ndarray:
    """One query token per sequence attending to its whole paged context (with sliding_window:
    to its last sliding_window positions, itself included).

    q: [num_seqs, num_heads, head_dim] (the token at position context_lens[i] - 1, already
        written to the cache)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32, each >= 1
    scale: softmax scale (usually head_dim ** -0.5)
    Returns [num_seqs, num_heads, head_dim].
    """
    _check_attention_shapes(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    context_lens = np.asarray(context_lens)
    if context_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables / context_lens rows must match q's num_seqs")
    q32 = _f32(q)
    out = np.empty(q.shape, dtype=np.float32)
    for i in range(num_seqs):
        context_len = int(context_lens[i])
        if context_len < 1:
            raise ValueError(f"sequence {i}: context_len must be >= 1, got {context_len}")
        k_ctx = _gather_context(k_cache, block_tables[i], context_len)
        v_ctx = _gather_context(v_cache, block_tables[i], context_len)
        out[i] = _attend(q32[i:i + 1], k_ctx, v_ctx, context_len - 1, scale, sliding_window)[0]
    return out.astype(_out_dtype(q))


def paged_prefill_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Causal attention of every scheduled token over its request's paged context (varlen); with
    sliding_window, a query at position i sees only keys j > i - sliding_window.

    q: [num_tokens, num_heads, head_dim], requests' tokens back to back
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (this step's k/v written)
    block_tables: [num_reqs, max_blocks] int32
    query_start_loc: [num_reqs + 1] int32; request i owns q rows qsl[i]:qsl[i+1]
    context_lens: [num_reqs] int32, KV length after this step's writes
    Request i's query tokens are the last query_len_i = qsl[i+1] - qsl[i] tokens of its context
    (positions context_len - query_len .. context_len - 1): each sees the cached context (prefix
    hits, earlier chunks) and its own chunk up to itself. A query_len 1 row is a decode row.
    Returns [num_tokens, num_heads, head_dim]; rows past qsl[num_reqs] (padding) are zero.
    """
    _check_attention_shapes(q, k_cache, v_cache)
    query_start_loc = np.asarray(query_start_loc)
    context_lens = np.asarray(context_lens)
    num_reqs = context_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_tables.shape[0] != num_reqs:
        raise ValueError("query_start_loc must be [num_reqs + 1], block_tables [num_reqs, ...]")
    if query_start_loc[0] != 0 or query_start_loc[-1] > q.shape[0] or np.any(
            np.diff(query_start_loc) < 0):
        raise ValueError("query_start_loc must start at 0, be non-decreasing, end <= num_tokens")
    q32 = _f32(q)
    out = np.zeros(q.shape, dtype=np.float32)
    for i in range(num_reqs):
        start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
        query_len, context_len = stop - start, int(context_lens[i])
        if query_len == 0:
            continue
        if context_len < query_len:
            raise ValueError(f"request {i}: context_len {context_len} < query_len {query_len}")
        k_ctx = _gather_context(k_cache, block_tables[i], context_len)
        v_ctx = _gather_context(v_cache, block_tables[i], context_len)
        out[start:stop] = _attend(q32[start:stop], k_ctx, v_ctx, context_len - query_len, scale,
                                  sliding_window)
    return out.astype(_out_dtype(q))


# --------------------------------------------------------------------------------- norms, MLP

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """out = x / sqrt(mean(x^2) + eps) * weight, per row, in float32.

    x: [num_tokens, hidden]; weight: [hidden]. Returns [num_tokens, hidden] (x's dtype policy).
    """
    x32 = _f32(x)
    inv_rms = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return (x32 * inv_rms.astype(np.float32) * _f32(weight)).astype(_out_dtype(x))


def fused_add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                       eps: float) -> tuple[np.ndarray, np.ndarray]:
    """new_residual = x + residual (float32), out = rms_norm(new_residual).

    x: [num_tokens, hidden] (a sublayer's output); residual: [num_tokens, hidden], the residual
    stream, carried in float32 whatever the activation dtype (HF semantics for the fp32 residual).
    Returns (out [num_tokens, hidden] in x's dtype policy, new_residual [num_tokens, hidden] f32).
    """
    new_residual = _f32(x) + _f32(residual)
    out = rms_norm(new_residual, weight, eps).astype(_out_dtype(x))
    return out, new_residual


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up for the gated MLP. gate_up: [num_tokens, 2 * intermediate], first half gate,
    second half up. Returns [num_tokens, intermediate].

    The loader keeps gate_proj and up_proj separate (as stored); the runner concatenates them into
    one [2 * intermediate, hidden] weight at load time so the MLP does one GEMM, then this op.
    """
    g32 = _f32(gate_up)
    if g32.shape[-1] % 2:
        raise ValueError(f"gate_up width {g32.shape[-1]} is odd")
    half = g32.shape[-1] // 2
    gate, up = g32[..., :half], g32[..., half:]
    # silu(g) = g * sigmoid(g); 1 / (1 + exp(-g)) saturates cleanly (exp overflow -> 0 result).
    with np.errstate(over="ignore"):
        silu = gate / (np.float32(1.0) + np.exp(-gate))
    return (silu * up).astype(_out_dtype(gate_up))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (PyTorch's gelu(approximate="tanh"), Gemma's
    gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32."""
    x32 = _f32(x)
    inner = np.float32(GELU_TANH_SQRT_2_OVER_PI) * (x32 + np.float32(GELU_TANH_CUBIC) * x32 ** 3)
    return np.float32(0.5) * x32 * (np.float32(1.0) + np.tanh(inner))


def gelu_tanh_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """gelu_tanh(gate) * up, Gemma's GeGLU MLP; silu_and_mul's layout: gate_up [num_tokens,
    2 * intermediate], gate half first. Returns [num_tokens, intermediate]."""
    g32 = _f32(gate_up)
    if g32.shape[-1] % 2:
        raise ValueError(f"gate_up width {g32.shape[-1]} is odd")
    half = g32.shape[-1] // 2
    return (gelu_tanh(g32[..., :half]) * g32[..., half:]).astype(_out_dtype(gate_up))


def scale_activations(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor (Gemma's embedding scale), the factor rounded to float32 first."""
    return (_f32(x) * np.float32(factor)).astype(_out_dtype(x))


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ weight.T (+ bias): one GEMM over all the step's tokens.

    x: [num_tokens, in_features]; weight: [out_features, in_features] (HF layout);
    bias: [out_features] or None. Returns [num_tokens, out_features].
    """
    out = _f32(x) @ _f32(weight).T
    if bias is not None:
        out += _f32(bias)
    return out.astype(_out_dtype(x))


def embedding(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Rows of the embedding table. token_ids: [num_tokens] int32 in [0, vocab); table:
    [vocab, hidden]. Returns [num_tokens, hidden] in the table's dtype policy."""
    token_ids = np.asarray(token_ids)
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= table.shape[0]):
        raise ValueError(f"token id out of range [0, {table.shape[0]})")
    return _f32(table[token_ids]).astype(_out_dtype(table))


# ------------------------------------------------------------------------- mixture of experts

def moe_route(router_logits: np.ndarray, top_k: int,
              renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each token's experts: softmax over the router logits in float32, then the top_k.

    router_logits: [num_tokens, num_experts] (the router GEMM's output).
    Returns topk_ids [num_tokens, top_k] int32, in decreasing probability (the lower expert id
    first on ties), and topk_weights [num_tokens, top_k] float32: their probabilities, divided
    by their sum when `renormalize` (Mixtral always; Qwen3-MoE per config norm_topk_prob).
    """
    logits = _f32(router_logits)
    if logits.ndim != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k {top_k} for router logits of shape {logits.shape}")
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    # A stable sort of -probs keeps equal probabilities in expert order.
    topk_ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    topk_weights = np.take_along_axis(probs, topk_ids, axis=1)
    if renormalize:
        topk_weights /= topk_weights.sum(axis=1, keepdims=True)
    return topk_ids.astype(np.int32), topk_weights.astype(np.float32)


def moe_experts(x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """The routed SwiGLU experts, grouped by expert (no per-token loop).

    x: [num_tokens, hidden]; topk_ids: [num_tokens, top_k] int in [0, num_experts);
    topk_weights: [num_tokens, top_k] float32; w_gate_up: [num_experts, 2 * inter, hidden]
    (per expert HF [out, in]: gate rows then up rows); w_down: [num_experts, hidden, inter].
    Returns y [num_tokens, hidden] float32,
        y[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = topk_ids[t, k].
    Under tensor parallelism the weights are a rank's intermediate slice and y a partial sum.
    """
    return grouped_moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, linear)


def grouped_moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, gemm) -> np.ndarray:
    """`moe_experts` with its two GEMMs per expert done by gemm(x [n, in], weight [out, in])
    -> [n, out] float32 (numpy's `linear` here; CpuBf16Backend passes its bf16 GEMM).

    The (token, k) pairs are sorted by expert (a stable argsort of the flattened ids), so each
    expert with tokens runs one GEMM pair over a contiguous group; experts with none cost
    nothing. Results are scaled by their routing weights and scatter-added back per token.
    """
    x32 = _f32(x)
    topk_ids = np.asarray(topk_ids)
    num_tokens, hidden = x32.shape
    num_experts, two_inter, weight_hidden = w_gate_up.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {topk_ids.shape} for {num_tokens} tokens")
    if np.shape(topk_weights) != topk_ids.shape:
        raise ValueError(f"topk_weights {np.shape(topk_weights)} != topk_ids {topk_ids.shape}")
    if weight_hidden != hidden or two_inter % 2 or w_down.shape != (
            num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights {w_gate_up.shape} / {w_down.shape} for hidden {hidden}")
    if topk_ids.size and (topk_ids.min() < 0 or topk_ids.max() >= num_experts):
        raise ValueError(f"expert id out of range [0, {num_experts})")
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = np.argsort(flat_ids, kind="stable")      # (token, k) pairs grouped by expert
    counts = np.bincount(flat_ids, minlength=num_experts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    pair_tokens = order // top_k
    pair_weights = _f32(topk_weights).reshape(-1)[order]
    out = np.zeros((num_tokens, hidden), np.float32)
    for e in np.flatnonzero(counts):
        group = slice(starts[e], starts[e + 1])
        tokens = pair_tokens[group]
        act = silu_and_mul(gemm(x32[tokens], w_gate_up[e]))
        y = gemm(act, w_down[e]) * pair_weights[group, None]
        # add.at: correct even when a token lists one expert twice (moe_route never does).
        np.add.at(out, tokens, y)
    return out


# --------------------------------------------------------------------------------- block moves

def copy_blocks(k_caches: list[np.ndarray], v_caches: list[np.ndarray],
                block_copies: np.ndarray) -> None:
    """Copy-on-write: copy whole block src -> dst in every layer's K and V cache, in place.

    k_caches, v_caches: one [num_blocks, block_size, num_kv_heads, head_dim] array per layer
    block_copies: [k, 2] int32 rows (src_block, dst_block). Destinations are distinct and no
    destination is also a source (COW copies from a shared block into a fresh one), so the copies
    are order-independent, as in the kernel where they run in parallel.
    """
    pairs = np.asarray(block_copies, dtype=np.int64).reshape(-1, 2)
    if pairs.shape[0] == 0:
        return
    src, dst = pairs[:, 0], pairs[:, 1]
    for cache in list(k_caches) + list(v_caches):
        _check_block_ids(pairs, cache.shape[0], "block_copies")
    if np.unique(dst).size != dst.size or np.intersect1d(src, dst).size:
        raise ValueError("block_copies: destinations must be distinct and not also sources")
    for cache in list(k_caches) + list(v_caches):
        cache[dst] = cache[src]


def swap_blocks(src_caches: list[np.ndarray], dst_caches: list[np.ndarray],
                block_pairs: np.ndarray) -> None:
    """Move whole blocks between two pools of identical block layout (device <-> host swap).

    src_caches, dst_caches: equal-length lists of per-layer caches (e.g. [k_0, v_0, k_1, ...]),
        each [num_blocks_of_that_pool, block_size, num_kv_heads, head_dim]; pools may differ in
        num_blocks only.
    block_pairs: [k, 2] int32 rows (src_block in the src pool, dst_block in the dst pool),
        destinations distinct.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source caches vs {len(dst_caches)} destination caches")
    pairs = np.asarray(block_pairs, dtype=np.int64).reshape(-1, 2)
    if pairs.shape[0] == 0:
        return
    if np.unique(pairs[:, 1]).size != pairs.shape[0]:
        raise ValueError("block_pairs: destination blocks must be distinct")
    for src_cache, dst_cache in zip(src_caches, dst_caches):
        if src_cache.shape[1:] != dst_cache.shape[1:]:
            raise ValueError(f"block layouts differ: {src_cache.shape} vs {dst_cache.shape}")
        if src_cache.dtype != dst_cache.dtype:  # numpy would convert bf16 bits as integers
            raise ValueError(f"pool dtypes differ: {src_cache.dtype} vs {dst_cache.dtype}")
        _check_block_ids(pairs[:, 0], src_cache.shape[0], "block_pairs source")
        _check_block_ids(pairs[:, 1], dst_cache.shape[0], "block_pairs destination")
        dst_cache[pairs[:, 1]] = src_cache[pairs[:, 0]]
