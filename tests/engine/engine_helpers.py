"""Shared helpers of the engine tests: tiny random Llama models (hidden 64, 2 layers) built in
memory, engines around them, a driver that adds requests at chosen steps, and the dense
reference's answers (the oracle; cached per model and prompt).

Weights are scaled so that the logits are spread out (a random model with too-small weights ties
its argmax constantly, and a greedy comparison would then test float rounding, not the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.weights import LayerWeights, ModelWeights

TINY_VOCAB = 384
TINY_HIDDEN = 64
TINY_LAYERS = 2
TINY_MAX_POSITIONS = 1024


def tiny_config(**overrides) -> ModelConfig:
    data = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": TINY_VOCAB,
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": TINY_MAX_POSITIONS,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    data.update(overrides)
    return ModelConfig.from_dict(data)


def random_weights(config: ModelConfig, seed: int = 0) -> ModelWeights:
    rng = np.random.default_rng(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.q_size, config.kv_size

    def mat(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(
            np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    def bias(n: int) -> np.ndarray | None:
        return (0.1 * rng.standard_normal(n)).astype(np.float32) if config.attention_bias else None

    layers = [LayerWeights(
        input_layernorm=norm_weight(), q_proj=mat(q_size, hidden), k_proj=mat(kv_size, hidden),
        v_proj=mat(kv_size, hidden), o_proj=mat(hidden, q_size), q_bias=bias(q_size),
        k_bias=bias(kv_size), v_bias=bias(kv_size),
        o_bias=bias(hidden) if config.o_proj_bias else None,
        post_attention_layernorm=norm_weight(), gate_proj=mat(inter, hidden),
        up_proj=mat(inter, hidden), down_proj=mat(hidden, inter),
    ) for _ in range(config.num_hidden_layers)]
    embed = rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)
    # A larger head scale spreads the logits: greedy decisions are far from ties.
    lm_head = embed if config.tie_word_embeddings else 4.0 * mat(config.vocab_size, hidden)
    return ModelWeights(config=config, embed_tokens=embed, layers=layers,
                        norm=norm_weight(), lm_head=lm_head)



@dataclass(frozen=True)
class EngineBackend:
    """One backend the engine tests run on: EngineConfig fields and tiny-model overrides."""

    name: str
    engine_kwargs: dict = field(default_factory=dict)
    model_overrides: dict = field(default_factory=dict)
    # Whether greedy tokens must equal the float32 dense reference (ReferenceModel). bf16 GEMM
    # inputs move the logits by ~1e-2 relative, so there the oracle is the same backend serving
    # each request alone: one prefill chunk, no prefix sharing, no preemption -- paging, batch
    # mixes and chunking must not change a token.
    exact_reference: bool = True
    # Logprobs against the float32 reference's log-softmax. bf16 GEMM inputs (relative error
    # 2^-9) on logits of magnitude ~20 move a logprob by up to ~0.04 (measured 0.038); 0.1 keeps
    # a real error (a wrong row, a missed penalty: whole units) far outside.
    logprob_atol: float = 1e-4


ENGINE_BACKENDS = {b.name: b for b in (
    EngineBackend("cpu", {"device": "cpu", "dtype": "float32"}),
    # kv_cache_dtype float32: "auto" would store bf16 KV, and its rounding flips a 0.001-nat
    # near-tie of test_engine_greedy's chunked-prefill mix against the one-chunk oracle (chunked
    # prefill is not bit-reproducible here). The bf16 KV cache: tests/engine/test_cpu_bf16_kv.py.
    EngineBackend("cpu-bf16", {"device": "cpu", "dtype": "bfloat16", "kv_cache_dtype": "float32"},
                  exact_reference=False, logprob_atol=0.1),
    EngineBackend("sim", {"device": "sim", "dtype": "float32"},
                  {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "intermediate_size": 160}),
)}


class EngineModel(tuple):
    """(ModelConfig, ModelWeights) that also names the backend its engines run on."""

    def __new__(cls, config, weights, backend: EngineBackend):
        self = super().__new__(cls, (config, weights))
        self.backend = backend
        return self

    def with_config(self, **overrides) -> "EngineModel":
        """The same weights under a tiny_config with these overrides (and the backend's)."""
        return EngineModel(tiny_config(**{**self.backend.model_overrides, **overrides}),
                           self[1], self.backend)


def backend_of(model) -> EngineBackend:
    """The backend a tiny model's engines run on (plain (config, weights) tuples: numpy)."""
    return getattr(model, "backend", ENGINE_BACKENDS["cpu"])


def assert_top_logprobs(top: dict, ref_row: np.ndarray, backend: EngineBackend) -> None:
    """`top` (token -> logprob, best first) against the reference row's log-softmax: the same
    tokens in the same order on exact backends; on the others each rank's value within the
    backend's tolerance of the reference's value at that rank, and each token's reference
    logprob within tolerance of what was reported (near-ties may swap)."""
    k = len(top)
    ref_top = np.argsort(-ref_row, kind="stable")[:k]
    atol = backend.logprob_atol
    if backend.exact_reference:
        assert list(top) == ref_top.tolist()
    else:
        assert np.allclose(list(top.values()), ref_row[ref_top], atol=atol)
    assert np.allclose(list(top.values()), ref_row[list(top)], atol=atol)


_REFERENCE_CACHE: dict[tuple, tuple[object, list[int]]] = {}  # key -> (weights, tokens)


def make_engine(model, tokenizer=None, **config) -> LLMEngine:
    """An engine over an in-memory model, on the model's backend (EngineModel) unless the
    test names a device. A block size the backend's kernels do not serve skips the test (the
    refusal itself is tested in test_engine_admission.py)."""
    from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

    model_config, weights = model
    backend = getattr(model, "backend", None)
    if backend is not None and "device" not in config:
        for key, value in backend.engine_kwargs.items():
            config.setdefault(key, value)
    config.setdefault("device", "cpu")
    config.setdefault("check_invariants", True)
    try:
        return LLMEngine(EngineConfig(**config), model_config=model_config, weights=weights,
                         tokenizer=tokenizer)
    except UnsupportedKernelShape as exc:
        if backend is None or "device" in config and backend.engine_kwargs.get(
                "device") != config["device"]:
            raise
        pytest.skip(f"backend {backend.name}: {exc}")


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The oracle's greedy tokens for `prompt` (see EngineBackend.exact_reference)."""
    backend = getattr(model, "backend", None)
    key = (id(model[1]), tuple(prompt), max_tokens)
    cached = _REFERENCE_CACHE.get(key)
    # The entry keeps its weights alive: an id is unique only among live objects, and a freed
    # model's id reused by another model must not hand out the freed one's tokens.
    if cached is None or cached[0] is not model[1]:
        if backend is None or backend.exact_reference:
            tokens = ReferenceModel(*model).greedy_generate(prompt, max_tokens)
        else:
            tokens = _solo_greedy(model, prompt, max_tokens)
        cached = _REFERENCE_CACHE[key] = (model[1], tokens)
    return cached[1]


def _solo_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of `prompt` served alone on the model's backend, the prompt in one chunk."""
    longest = len(prompt) + max_tokens
    engine = make_engine(model, block_size=16, max_model_len=max(longest, 16),
                         num_kv_blocks=-(-longest // 16) + 1, enable_prefix_caching=False,
                         max_num_batched_tokens=max(longest, 16), max_num_seqs=1)
    engine.add_request("solo", prompt_token_ids=prompt, sampling_params=greedy(max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.outputs[0].token_ids
    return tokens


def random_prompts(rng: np.random.Generator, vocab: int, num: int, max_len: int,
                   shared_prefix: list[int] | None = None) -> list[list[int]]:
    """Prompts with long-tailed lengths in [1, max_len]; token 0..2 (specials) avoided."""
    prompts = []
    for _ in range(num):
        length = int(min(max_len, 1 + rng.geometric(1.0 / (max_len / 4))))
        body = rng.integers(3, vocab, length).tolist()
        if shared_prefix is not None and rng.random() < 0.7:
            body = (shared_prefix + body)[:max_len]
        prompts.append(body)
    return prompts


def run_requests(engine: LLMEngine, requests: list[tuple[int, str, dict]],
                 max_steps: int = 100_000, before_step=None) -> dict[str, "object"]:
    """Drive the engine: requests are (arrival_step, request_id, add_request kwargs).
    before_step(engine, step, totals), if given, runs before each step (after that step's
    arrivals): aborts at chosen points, for instance.

    Returns request_id -> accumulated final RequestOutput (token ids, text, logprobs of every
    completion, concatenated from the streaming deltas).
    """
    from pagedrun.runtime.llm import _merge

    pending = sorted(requests, key=lambda r: r[0])
    totals = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, kwargs = pending.pop(0)
            engine.add_request(request_id, **kwargs)
        if before_step is not None:
            before_step(engine, step, totals)
        for delta in engine.step():
            totals[delta.request_id] = _merge(totals.get(delta.request_id), delta)
        step += 1
        assert step < max_steps, "engine did not finish"
    return totals


class PieceTokenizer:
    """A tokenizer for the tiny models whose token i is a fixed 1-3 character string drawn from
    ALPHABET (ids 0-2 are the special tokens "<pad>", "<s>", "</s>"); decode concatenates the
    pieces. `special`: more ids made special, with the text given (an end-of-turn token)."""

    ALPHABET = "ab c."

    def __init__(self, seed: int = 0, special: dict[int, str] | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.pieces = ["<pad>", "<s>", "</s>"] + [
            "".join(rng.choice(list(self.ALPHABET), int(rng.integers(1, 4))))
            for _ in range(TINY_VOCAB - 3)]
        self.special_ids = {0, 1, 2}
        for token_id, text in (special or {}).items():
            self.pieces[token_id] = text
            self.special_ids.add(token_id)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[t] for t in token_ids
                       if not (skip_special_tokens and t in self.special_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError("the tests send token ids")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prefill_logits(config: ModelConfig, weights: ModelWeights, backend, tokens: list[int],
                   backend_caches: bool = False):
    """Logits [len(tokens), vocab] of every position of one prefill through LlamaModel on
    `backend` (fresh zero KV caches, one sequence). backend_caches: the caches in the
    backend's own arrays and cache dtype (backend.zeros, backend.kv_dtype) and the result
    (host float32 logits, the model); else float32 numpy caches and the backend's logits."""
    from pagedrun.runtime.model_runner import build_attention_inputs
    from pagedrun.runtime.models.llama import LlamaModel

    block_size, num_tokens = 16, len(tokens)
    num_blocks = -(-num_tokens // block_size)
    model = LlamaModel(config, weights, backend, max_position=256)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    if backend_caches:
        kv_dtype = getattr(backend, "kv_dtype", np.float32)
        k_caches = [backend.zeros(shape, kv_dtype) for _ in range(config.num_hidden_layers)]
        v_caches = [backend.zeros(shape, kv_dtype) for _ in range(config.num_hidden_layers)]
    else:
        k_caches = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        v_caches = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
    attn = build_attention_inputs(np.array([0, num_tokens], np.int32),
                                  np.array([num_tokens], np.int32),
                                  np.array([num_tokens], np.int32),
                                  np.arange(num_blocks, dtype=np.int32)[None, :])
    positions = np.arange(num_tokens, dtype=np.int32)
    x, residual = model.forward(np.asarray(tokens, np.int32), positions, positions, attn,
                                k_caches, v_caches)
    if backend_caches:
        return np.asarray(backend.to_host(model.logits(x, residual)), np.float32), model
    return model.logits(x, residual)


def fake_quantize_rows(x: np.ndarray, activations: str) -> np.ndarray:
    """The activations the quantized GEMMs (cpu_gemm.gemm_gguf: the gguf and int4 paths)
    multiply: x [M, K] with every 32-wide block of a row replaced by the value its int8
    quantization stands for (float64). "q8": dx * round(x / dx), dx = max |block| / 127 in
    float32; "q8x2": plus dx2 * round(r / dx2) for the residual r = x - dx * qx, dx2 = dx /
    256."""
    m, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(m, k // 32, 32)
    dx = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    safe = np.where(dx == 0, np.float32(1), dx)
    qx = np.rint(blocks / safe) * (dx != 0)
    value = qx.astype(np.float64) * dx
    if activations == "q8x2":
        residual = (blocks.astype(np.float64) - value).astype(np.float32)
        dx2 = dx / np.float32(256)
        qx2 = np.clip(np.rint(residual / np.where(dx == 0, np.float32(1), dx2)), -127, 127)
        value = value + qx2 * (dx != 0) * dx2.astype(np.float64)
    return value.reshape(m, k)
