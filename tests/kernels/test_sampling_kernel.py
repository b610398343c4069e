"""cuda/sampling.cu (through runtime/kernels/sampling.py) against runtime/sampler.py.

- greedy equals argmax exactly (planted ties: the lowest id wins; banned tokens never win);
- penalties and min_tokens bans are bit-identical to the numpy sampler's;
- with the same uniforms the kernel picks the numpy sampler's token (top-k, top-p, min-p,
  temperature, all combined), rows mixed in one batch;
- statistically: 3,000 draws of one filtered distribution pass a chi-square goodness-of-fit test
  against the numpy filter's exact probabilities at 99.9% confidence (fixed seed), and no draw
  ever lands on a token the numpy filters remove;
- KernelSampler equals Sampler (same seeds -> same tokens, same logprobs)."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import kernel_module, to_device, to_host
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.backends.kernel_sampler import KernelSampler
from pagedrun.runtime.kernels.sampling import apply_penalties, sample
from pagedrun.runtime.sampler import (Sampler, _sample_rows, _top_k_filter, _top_p_filter,
                                      apply_min_tokens, make_request_generator)
from pagedrun.runtime.sampler import apply_penalties as numpy_penalties
from pagedrun.runtime.sampling_params import SamplingParams

# Goodness of fit: reject "the kernel draws from the numpy distribution" only below this p-value.
CHI2_CONFIDENCE = 0.999
NUM_DRAWS = 3000
# Chi-square bins need enough expected draws; rarer tokens are pooled into one bin.
MIN_EXPECTED_PER_BIN = 5


def mod():
    return kernel_module("sampling.cu")


@pytest.mark.parametrize("vocab", (1, 17, 1000, 32001))
def test_greedy_is_argmax_exactly(rng, vocab):
    rows = 7
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    if vocab > 1:
        # Planted ties: the maximum appears twice; the lower id must win.
        hi = rng.integers(1, vocab, rows)
        lo = rng.integers(0, hi)
        logits[np.arange(rows), hi] = 10.0
        logits[np.arange(rows), lo] = 10.0
        logits[0, :] = -np.inf  # everything banned: token 0, as numpy's argmax
    params = [SamplingParams(temperature=0.0)] * rows
    out = to_host(sample(mod(), to_device(logits), params, np.zeros(rows)))
    np.testing.assert_array_equal(out, np.argmax(logits, axis=1))


def test_penalties_and_bans_are_bit_identical(rng):
    rows, vocab = 6, 389
    logits = (4 * rng.standard_normal((rows, vocab))).astype(np.float32)
    params = [SamplingParams(repetition_penalty=1.3),
              SamplingParams(frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1,
                             min_tokens=5, stop_token_ids=[3, 7]),
              SamplingParams(),
              SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[11]),
              SamplingParams(min_tokens=1, repetition_penalty=2.0)]
    prompts = [rng.integers(0, vocab, n) for n in (5, 0, 30, 3, 4, 9)]
    outputs = [list(rng.integers(0, vocab, n)) for n in (8, 20, 3, 2, 1, 0)]
    eos = [2, 388]
    expected = logits.copy()
    numpy_penalties(expected, params, prompts, outputs)
    apply_min_tokens(expected, params, outputs, eos)
    dev = to_device(logits.copy())
    apply_penalties(mod(), dev, params, prompts, outputs, eos)
    np.testing.assert_array_equal(to_host(dev), expected)


CONFIGS = [dict(temperature=0.7), dict(top_k=1), dict(top_k=7), dict(top_p=0.5),
           dict(top_p=0.95, temperature=1.5), dict(min_p=0.2),
           dict(top_k=40, top_p=0.8, min_p=0.02),
           dict(top_k=2000)]


@pytest.mark.parametrize("vocab", (111, 4099))
def test_same_uniforms_same_tokens_as_numpy(rng, vocab):
    rows_per_config = 6
    params = [SamplingParams(**kw) for kw in CONFIGS for _ in range(rows_per_config)]
    params += [SamplingParams(temperature=0.0)] * 3  # greedy rows in the same batch
    rows = len(params)
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    uniforms = rng.random(rows)
    out = to_host(sample(mod(), to_device(logits), params, uniforms))
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    expected = np.argmax(logits, axis=1).astype(np.int32)
    expected[sampled] = _sample_rows(logits[sampled].copy(), [params[i] for i in sampled],
                                     uniforms[sampled])
    # Only a uniform within float32 rounding of a CDF boundary could pick a neighbour.
    mismatches = np.flatnonzero(out != expected)
    assert mismatches.size <= 1, \
        f"rows {mismatches}: kernel {out[mismatches]}, numpy {expected[mismatches]}"


def _numpy_probabilities(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Exact distribution of the numpy sampler's steps 5-8 for one row."""
    scaled = row / np.float32(p.temperature)
    _top_k_filter(scaled, p.top_k)
    weights = np.exp(scaled - scaled.max()).astype(np.float32)
    if p.top_p < 1.0:
        _top_p_filter(weights, p.top_p)
    weights[weights < p.min_p] = 0.0
    return weights.astype(np.float64) / weights.sum(dtype=np.float64)


def _chi2_threshold(dof: int, confidence: float) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(confidence, dof))
    except ImportError:  # Wilson-Hilferty, accurate to ~1% here
        z = {0.999: 3.090}[confidence]
        return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray, n: int) -> tuple[float, int]:
    expected = probs * n
    big = expected >= MIN_EXPECTED_PER_BIN
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    obs, exp = np.array(obs, float), np.array(exp, float)
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("config", [dict(top_k=12), dict(top_p=0.8), dict(min_p=0.05),
                                    dict(top_k=30, top_p=0.9, min_p=0.01, temperature=0.7)])
def test_draw_distribution_matches_numpy(config):
    rng = np.random.default_rng(20261129)  # fixed: a statistical test must not flake
    vocab = 97
    row = (2 * rng.standard_normal(vocab)).astype(np.float32)
    p = SamplingParams(**config)
    probs = _numpy_probabilities(row.copy(), p)
    logits = np.ascontiguousarray(np.broadcast_to(row, (NUM_DRAWS, vocab)))
    uniforms = rng.random(NUM_DRAWS)
    out = to_host(sample(mod(), to_device(logits), [p] * NUM_DRAWS, uniforms))
    assert np.all(probs[out] > 0), "a draw landed on a token the numpy filters remove"
    counts = np.bincount(out, minlength=vocab)
    stat, dof = _chi2(counts, probs, NUM_DRAWS)
    assert stat < _chi2_threshold(dof, CHI2_CONFIDENCE), (stat, dof)
    # The reference distribution itself: the numpy sampler's draws pass the same test.
    ref = _sample_rows(logits.copy(), [p] * NUM_DRAWS, rng.random(NUM_DRAWS))
    ref_stat, ref_dof = _chi2(np.bincount(ref, minlength=vocab), probs, NUM_DRAWS)
    assert ref_stat < _chi2_threshold(ref_dof, CHI2_CONFIDENCE)


def test_kernel_sampler_equals_numpy_sampler(rng):
    vocab = 301
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=7, top_k=20),
              SamplingParams(top_p=0.9, repetition_penalty=1.2, logprobs=0),
              SamplingParams(seed=11, min_p=0.1, min_tokens=4, stop_token_ids=[5]),
              SamplingParams(temperature=1.3, frequency_penalty=0.5)]
    rows = len(params)
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    prompts = [rng.integers(0, vocab, 6) for _ in range(rows)]
    outputs = [list(rng.integers(0, vocab, 3)) for _ in range(rows)]

    def gens():
        return [make_request_generator(p.seed) for p in params]

    ref = Sampler([2], seed=3).sample(logits.copy(), params, gens(), prompts, outputs)
    got = KernelSampler(mod(), [2], seed=3).sample(to_device(logits), params, gens(), prompts,
                                                   outputs)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    assert got.logprobs == ref.logprobs


def test_negative_cases():
    with pytest.raises(UnsupportedKernelShape, match="float32"):
        sample(mod(), np.zeros((2, 5), np.float16), [SamplingParams()] * 2, np.zeros(2))
    with pytest.raises(UnsupportedKernelShape, match="params"):
        sample(mod(), np.zeros((2, 5), np.float32), [SamplingParams()], np.zeros(2))
    with pytest.raises(ValueError, match="out of range"):
        apply_penalties(mod(), np.zeros((1, 5), np.float32), [SamplingParams(presence_penalty=1.0)],
                        [[]], [[9]])
