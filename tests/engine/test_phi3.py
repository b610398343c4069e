"""Phi-3 (runtime/families/phi3.py): the Llama forward over a checkpoint that stores q/k/v as
one qkv_proj and gate/up as one gate_up_proj, with a sliding window over every layer, against
transformers.

tests/fixtures/tiny/phi3_tiny (tests/fixtures/make_fixtures.py) is a tiny random Phi-3 (GQA
4/2, head_dim 64, window 7, untied) and its expected.npz: transformers' greedy tokens and
logits for prompts of 1, 5, 13 and 21 tokens (the last two longer than the window, so a wrong
mask changes their logits: `test_the_window_is_what_makes_the_logits`). Checked here: the
fused tensors split into the right fields; the dense reference against transformers' logits;
the paged engine on every engine backend against transformers' tokens and logprobs (within the
window, to which the engine caps max_model_len); the configs Phi-3 cannot run refused by name.
Tensor parallelism over the fused tensors: tests/distributed/test_tp_phi3.py.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from engine_helpers import ENGINE_BACKENDS, EngineModel, greedy, make_engine, reference_greedy, \
    run_requests
from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.llama import LlamaModel
from pagedrun.runtime.models.registry import forward_of
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.weights import SafetensorsCheckpoint, load_model_weights

PHI3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "phi3_tiny"
HF_PROMPT_LENGTHS = (1, 5, 13, 21)
MAX_MODEL_LEN = 128  # the fixture's max_position_embeddings
# Two float32 forwards (numpy and torch) of logits up to ~10 through 2 layers of width 256:
# summation order alone moved them by 5.6e-5 at most (the 13-token prompt); a wrong split,
# window or rotation moves them by > 0.1 (test_the_window_is_what_makes_the_logits), and the
# smallest greedy margin of the fixture is 0.036.
REFERENCE_LOGITS_ATOL = 5e-4


def hf_cases() -> list[tuple[list[int], list[int], np.ndarray]]:
    """(prompt, transformers' greedy tokens, its logits [P + N - 1, vocab]) per fixture prompt."""
    data = np.load(PHI3_DIR / "expected.npz")
    return [(data[f"prompt_{n}"].tolist(), data[f"generated_{n}"].tolist(), data[f"logits_{n}"])
            for n in HF_PROMPT_LENGTHS]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def phi3():
    config = ModelConfig.from_model_dir(PHI3_DIR)
    return config, load_model_weights(PHI3_DIR, config)


def test_config_and_forward(phi3):
    config, _ = phi3
    assert config.architecture == "Phi3ForCausalLM"
    assert forward_of(config).model_class is LlamaModel
    assert config.sliding_window == 7 and config.head_dim == 64
    assert not (config.attention_bias or config.qk_norm or config.tie_word_embeddings)


def test_fused_tensors_split_into_their_fields(phi3):
    """q, k, v are the qkv_proj rows [0, q), [q, q + kv), [q + kv, q + 2 kv); gate and up
    the two halves of gate_up_proj (transformers' chunk(2) order)."""
    config, weights = phi3
    raw = SafetensorsCheckpoint(PHI3_DIR)
    assert "model.layers.0.self_attn.q_proj.weight" not in raw
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for i, layer in enumerate(weights.layers):
        qkv = raw.get(f"model.layers.{i}.self_attn.qkv_proj.weight")
        np.testing.assert_array_equal(layer.q_proj, qkv[:q])
        np.testing.assert_array_equal(layer.k_proj, qkv[q:q + kv])
        np.testing.assert_array_equal(layer.v_proj, qkv[q + kv:])
        gate_up = raw.get(f"model.layers.{i}.mlp.gate_up_proj.weight")
        np.testing.assert_array_equal(layer.gate_proj, gate_up[:inter])
        np.testing.assert_array_equal(layer.up_proj, gate_up[inter:])
        assert layer.q_proj.flags.c_contiguous and layer.up_proj.flags.c_contiguous


def test_reference_matches_transformers(phi3):
    config, weights = phi3
    reference = ReferenceModel(config, weights)
    for prompt, generated, hf_logits in hf_cases():
        logits = reference.forward(np.array(prompt + generated[:-1]))
        np.testing.assert_allclose(logits, hf_logits, rtol=0, atol=REFERENCE_LOGITS_ATOL)
        assert reference_greedy((config, weights), prompt, len(generated)) == generated


def test_the_window_is_what_makes_the_logits(phi3):
    """Without the window (or with q and k swapped in the split) the 21-token prompt's logits
    are not transformers': the test above can fail."""
    config, weights = phi3
    prompt, generated, hf_logits = hf_cases()[3]
    sequence = np.array(prompt + generated[:-1])
    unwindowed = ReferenceModel(dataclasses.replace(config, sliding_window=None), weights)
    assert np.abs(unwindowed.forward(sequence) - hf_logits).max() > 0.1
    swapped = dataclasses.replace(weights, layers=[
        dataclasses.replace(layer, gate_proj=layer.up_proj, up_proj=layer.gate_proj)
        for layer in weights.layers])
    assert np.abs(ReferenceModel(config, swapped).forward(sequence) - hf_logits).max() > 0.1


@pytest.fixture(scope="module", params=list(ENGINE_BACKENDS))
def tiny_model(request, phi3):
    """The Phi-3 fixture on each engine backend (named like conftest's fixture so that
    --engine-backends selects here too). head_dim 64 is one the sim kernels serve."""
    return EngineModel(*phi3, ENGINE_BACKENDS[request.param])


def test_engine_tokens_and_logprobs_match_transformers(tiny_model):
    """Greedy tokens, their logprobs and the prompts' logprobs against transformers' logits,
    through the paged engine, the prompts chunked by a 3-token budget and batched together.
    A stack-wide window caps max_model_len to it (kv_capacity.resolve_max_model_len, as for
    Mistral), so the engine serves the cases that fit in 7 positions: the 1- and 5-token
    prompts and the first 6 and 2 of transformers' tokens."""
    config, backend = tiny_model[0], tiny_model.backend
    window = config.sliding_window
    engine = make_engine(tiny_model, block_size=16, num_kv_blocks=4, max_model_len=window,
                         max_num_batched_tokens=3)
    assert engine.max_model_len == window
    cases = [(prompt, generated[:window - len(prompt)], hf_logits)
             for prompt, generated, hf_logits in hf_cases() if len(prompt) < window]
    assert [len(p) + len(g) for p, g, _ in cases] == [window, window]
    outputs = run_requests(engine, [
        (i, f"hf-{i}", dict(prompt_token_ids=prompt, sampling_params=greedy(
            len(generated), logprobs=3, prompt_logprobs=1)))
        for i, (prompt, generated, _) in enumerate(cases)])
    for i, (prompt, generated, hf_logits) in enumerate(cases):
        completion = outputs[f"hf-{i}"].outputs[0]
        want = (generated if backend.exact_reference
                else reference_greedy(tiny_model, prompt, len(generated)))
        assert completion.token_ids == want
        lp = log_softmax(hf_logits)  # row j predicts token j + 1 of prompt + generated
        # Compare while our context is transformers' (always on exact backends).
        same = next((k for k, (a, b) in enumerate(zip(completion.token_ids, generated))
                     if a != b), len(generated)) + 1
        for k, (position, token) in enumerate(zip(completion.logprobs[:same],
                                                  completion.token_ids)):
            assert abs(position[token].logprob - lp[len(prompt) - 1 + k][token]) < \
                backend.logprob_atol
        full = prompt + generated
        prompt_lp = outputs[f"hf-{i}"].prompt_logprobs
        for j in range(1, len(prompt)):
            assert abs(prompt_lp[j][full[j]].logprob - lp[j - 1][full[j]]) < \
                backend.logprob_atol
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _phi3_config(**overrides) -> dict:
    import json

    return {**json.loads((PHI3_DIR / "config.json").read_text()), **overrides}


@pytest.mark.parametrize("change, field", [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.75}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                          "short_factor": [1.0] * 32, "long_factor": [1.0] * 32}},
     "rope_parameters"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_configs_phi3_cannot_run_are_refused(change, field):
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dict(_phi3_config(**change))
    assert field in str(info.value)
