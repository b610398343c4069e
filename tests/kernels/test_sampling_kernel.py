"""cuda/sampling.cu (through runtime/kernels/sampling.py) against runtime/sampler.py.

- greedy equals argmax exactly (planted ties: the lowest id wins; banned tokens never win);
- the logits processors (allowed-token mask, bad-word and min_tokens bans, logit bias,
  penalties) are bit-identical to the numpy sampler's;
- with the same uniforms the kernel picks the numpy sampler's token (min-p, top-k, top-p,
  temperature, all combined), rows mixed in one batch;
- statistically: 3,000 draws of one filtered distribution pass a chi-square goodness-of-fit test
  against the numpy filter's exact probabilities at 99.9% confidence (fixed seed), and no draw
  ever lands on a token the numpy filters remove (tests/engine/test_sampling_distribution.py
  checks both samplers against an independent reference of vLLM's rules);
- KernelSampler equals Sampler (same seeds -> same tokens, same logprobs, every logprobs_mode);
- rows with every token masked, and extreme values, give token 0 / finite choices, no NaN."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import kernel_module, to_device, to_host
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.backends.kernel_sampler import KernelSampler
from pagedrun.runtime.engine_config import LOGPROBS_MODES
from pagedrun.runtime.kernels.sampling import process_logits, sample
from pagedrun.runtime.sampler import (Sampler, inverse_cdf, apply_logits_processors,
                                      filter_rows, make_request_generator)
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


def test_logits_processors_are_bit_identical(rng):
    rows, vocab = 9, 389
    logits = (4 * rng.standard_normal((rows, vocab))).astype(np.float32)
    params = [SamplingParams(repetition_penalty=1.3),
              SamplingParams(frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1,
                             min_tokens=5, stop_token_ids=[3, 7]),
              SamplingParams(),
              SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[11]),
              SamplingParams(min_tokens=1, repetition_penalty=2.0),
              # bias on a penalized token, on a banned one (stays -inf), on a plain one
              SamplingParams(logit_bias={5: 2.5, 2: 50.0, 100: -3.25}, repetition_penalty=1.5,
                             min_tokens=9),
              # allowed list with a bias and a penalty inside it and a bias outside it
              SamplingParams(allowed_token_ids=[388, 0, 17, 40, 41], logit_bias={17: 1.0, 60: 9.0},
                             frequency_penalty=0.5),
              # bad words: a one-token word (always), a matching 3-token word, a non-matching one
              SamplingParams(_bad_words_token_ids=[[12], [8, 9, 30], [7, 31]],
                             presence_penalty=-0.5)]
    prompts = [rng.integers(0, vocab, n) for n in (5, 0, 30, 3, 4, 9, 6, 2, 3)]
    outputs = [list(rng.integers(0, vocab, n)) for n in (8, 20, 3, 2, 1, 0, 4, 6, 0)]
    # Row 6's token 100 must see its bias alone (checked below), so no penalty may reach it:
    # keep it out of that row's random prompt and output.
    prompts[6] = prompts[6][prompts[6] != 100]
    outputs[6] = [5] + [t for t in outputs[6][1:] if t != 100]
    outputs[7] += [17, 17, 60]
    outputs[8] = [1, 8, 9]
    eos = [2, 388]
    expected = logits.copy()
    apply_logits_processors(expected, params, prompts, outputs, eos)
    dev = to_device(logits.copy())
    process_logits(mod(), dev, params, prompts, outputs, eos)
    got = to_host(dev)
    np.testing.assert_array_equal(got, expected)
    # The masks landed where vLLM puts them (not only "as numpy does").
    assert np.isneginf(got[2, [2, 3, 7, 388]]).all()
    assert np.isneginf(got[4, [2, 11, 388]]).all()  # eos masked although ignore_eos
    assert np.isneginf(got[6, 2]) and got[6, 100] == logits[6, 100] - np.float32(3.25)
    allowed = np.zeros(vocab, bool)
    allowed[[388, 0, 17, 40, 41]] = True
    assert np.isneginf(got[7, ~allowed]).all() and np.isfinite(got[7, allowed]).all()
    assert np.isneginf(got[8, [12, 30]]).all() and np.isfinite(got[8, 31])


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
    _, weights = filter_rows(logits[sampled], [params[i] for i in sampled])
    expected[sampled] = inverse_cdf(weights, uniforms[sampled])
    # Only a uniform within float32 rounding of a CDF boundary could pick a neighbour.
    mismatches = np.flatnonzero(out != expected)
    assert mismatches.size <= 1, \
        f"rows {mismatches}: kernel {out[mismatches]}, numpy {expected[mismatches]}"


def _numpy_probabilities(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Exact distribution of the numpy sampler's steps 6-9 for one row."""
    _, weights = filter_rows(row[None], [p])
    return weights[0].astype(np.float64) / weights[0].sum(dtype=np.float64)


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
    ref = inverse_cdf(filter_rows(logits, [p] * NUM_DRAWS)[1], rng.random(NUM_DRAWS))
    ref_stat, ref_dof = _chi2(np.bincount(ref, minlength=vocab), probs, NUM_DRAWS)
    assert ref_stat < _chi2_threshold(ref_dof, CHI2_CONFIDENCE)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_kernel_sampler_equals_numpy_sampler(rng, mode):
    vocab = 301
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 1.5}),
              SamplingParams(seed=7, top_k=20, allowed_token_ids=list(range(0, 300, 7))),
              SamplingParams(top_p=0.9, repetition_penalty=1.2, logprobs=0),
              SamplingParams(seed=11, min_p=0.1, min_tokens=4, stop_token_ids=[5], logprobs=-1),
              SamplingParams(temperature=1.3, frequency_penalty=0.5, logprobs=2,
                             _bad_words_token_ids=[[9], [3, 4]], logit_bias={10: -2.0}),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=5,
                             allowed_token_ids=[1, 2, 3, 50, 51, 52, 200])]
    rows = len(params)
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    prompts = [rng.integers(0, vocab, 6) for _ in range(rows)]
    outputs = [list(rng.integers(0, vocab, 3)) for _ in range(rows)]
    outputs[4][-1] = 3

    def gens():
        return [make_request_generator(p.seed) for p in params]

    ref = Sampler([2], seed=3, logprobs_mode=mode).sample(logits.copy(), params, gens(), prompts,
                                                          outputs)
    got = KernelSampler(mod(), [2], seed=3, logprobs_mode=mode).sample(
        to_device(logits), params, gens(), prompts, outputs)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    assert got.logprobs == ref.logprobs
    assert [lp is None for lp in got.logprobs] == [p.logprobs is None for p in params]
    assert len(got.logprobs[3].top_token_ids) == vocab  # logprobs=-1: the whole vocabulary


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_forked_rows_share_one_row_on_the_kernels(rng, mode):
    """n > 1 first tokens (runtime/logits_row_groups.py): the siblings' shared row is processed
    once and sample_f32 reads it through its row map; the tokens and logprobs are the numpy
    Sampler's on the same shared batch, and the numpy Sampler's with every sibling given its
    own copy of the row (tests/engine/test_shared_sampling_rows.py checks the numpy side)."""
    vocab = 1000
    fork_a = SamplingParams(n=3, seed=4, temperature=0.9, top_k=20, top_p=0.9,
                            repetition_penalty=1.4, logprobs=2)
    fork_b = SamplingParams(n=2, temperature=0.5, top_k=1, logit_bias={5: 3.0}, logprobs=1)
    alone = SamplingParams(seed=9, temperature=0.7, min_p=0.05)
    prompt_a, prompt_b = rng.integers(0, vocab, 5), rng.integers(0, vocab, 4)
    params = [fork_a] * 3 + [fork_b] * 2 + [alone]
    prompts = [prompt_a] * 3 + [prompt_b] * 2 + [rng.integers(0, vocab, 3)]
    outputs = [[], [], [], [], [], list(rng.integers(0, vocab, 2))]
    row_index = [2, 2, 2, 0, 0, 1]
    logits = (3 * rng.standard_normal((3, vocab))).astype(np.float32)

    def gens():
        return [make_request_generator(None if p.seed is None else p.seed + j)
                for j, p in enumerate(params)]

    got = KernelSampler(mod(), [2], seed=3, logprobs_mode=mode).sample(
        to_device(logits), params, gens(), prompts, outputs, row_index=row_index)
    shared = Sampler([2], seed=3, logprobs_mode=mode).sample(
        logits.copy(), params, gens(), prompts, outputs, row_index=row_index)
    copies = Sampler([2], seed=3, logprobs_mode=mode).sample(
        logits[row_index], params, gens(), [p.copy() for p in prompts],
        [list(o) for o in outputs])
    np.testing.assert_array_equal(got.token_ids, shared.token_ids)
    np.testing.assert_array_equal(shared.token_ids, copies.token_ids)
    assert got.logprobs == shared.logprobs == copies.logprobs


def test_sample_f32_row_map_is_checked(rng):
    logits = to_device(rng.standard_normal((2, 17)).astype(np.float32))
    params = [SamplingParams(temperature=0.0)] * 3
    with pytest.raises(ValueError, match="outside"):
        sample(mod(), logits, params, np.zeros(3), logits_rows=[0, 2, 1])
    with pytest.raises(ValueError, match="entries"):
        sample(mod(), logits, params, np.zeros(3), logits_rows=[0, 1])
    tokens = sample(mod(), logits, params, np.zeros(3), logits_rows=[1, 0, 1])
    host = to_host(logits)
    np.testing.assert_array_equal(to_host(tokens), np.argmax(host[[1, 0, 1]], axis=1))


@pytest.mark.parametrize("processing", [False, True], ids=["plain", "penalized"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_kernel_sampler_leaves_the_callers_logits(rng, processing, mode):
    """Rows with nothing to process sample the logits where they are (no copy); rows with a
    penalty or bias are processed on a copy: either way the caller's logits (the runner's
    output, or a decode graph's buffer) are unchanged, and the tokens are the numpy
    Sampler's."""
    vocab = 257
    extra = dict(repetition_penalty=1.5, logit_bias={7: 50.0}) if processing else {}
    params = [SamplingParams(temperature=0.0, logprobs=2, **extra),
              SamplingParams(seed=5, temperature=0.8, top_k=30, **extra),
              SamplingParams(temperature=0.0)]
    logits = (3 * rng.standard_normal((len(params), vocab))).astype(np.float32)
    prompts = [rng.integers(0, vocab, 5) for _ in params]
    outputs = [list(rng.integers(0, vocab, 2)) for _ in params]
    device_logits = to_device(logits)
    got = KernelSampler(mod(), [2], seed=3, logprobs_mode=mode).sample(
        device_logits, params, [make_request_generator(p.seed) for p in params], prompts,
        outputs)
    ref = Sampler([2], seed=3, logprobs_mode=mode).sample(
        logits.copy(), params, [make_request_generator(p.seed) for p in params], prompts,
        outputs)
    np.testing.assert_array_equal(to_host(device_logits), logits)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    assert got.logprobs == ref.logprobs


@pytest.mark.parametrize("vocab", (1, 17, 111))
def test_masked_rows_and_extreme_values(vocab):
    """Every token masked -> token 0 (greedy or sampled, as the numpy sampler); huge logits,
    +inf, NaN and extreme temperatures -> a token in the vocabulary, never NaN-driven."""
    rows = 6
    logits = np.full((rows, vocab), -np.inf, np.float32)  # rows 0-1: all masked
    logits[2] = np.float32(3e38)                          # overflows once divided by 0.01
    logits[3, :] = -3e38
    logits[3, vocab - 1] = np.inf
    logits[4, :] = np.nan
    logits[4, vocab // 2] = 1.0
    logits[5] = np.linspace(-1e30, 1e30, vocab, dtype=np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.01, top_k=3, min_p=0.9),
              SamplingParams(temperature=2.0, top_p=0.1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.01, min_p=1.0)]
    uniforms = np.array([0.0, 0.5, 0.999, 0.3, 0.7, 0.2])
    out = to_host(sample(mod(), to_device(logits), params, uniforms))
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    expected = np.argmax(logits, axis=1).astype(np.int32)
    expected[0] = 0
    _, weights = filter_rows(logits[sampled], [params[i] for i in sampled])
    assert np.isfinite(weights).all()
    expected[sampled] = inverse_cdf(weights, uniforms[sampled])
    np.testing.assert_array_equal(out, expected)
    assert out[0] == 0 and out[1] == 0 and out[3] == vocab - 1 and out[4] == vocab // 2
    assert out[5] == vocab - 1


def test_negative_cases():
    with pytest.raises(UnsupportedKernelShape, match="float32"):
        sample(mod(), np.zeros((2, 5), np.float16), [SamplingParams()] * 2, np.zeros(2))
    with pytest.raises(UnsupportedKernelShape, match="params"):
        sample(mod(), np.zeros((2, 5), np.float32), [SamplingParams()], np.zeros(2))
    with pytest.raises(ValueError, match="out of range"):
        process_logits(mod(), np.zeros((1, 5), np.float32), [SamplingParams(presence_penalty=1.0)],
                       [[]], [[9]])
    with pytest.raises(ValueError, match="out of range"):
        process_logits(mod(), np.zeros((1, 5), np.float32), [SamplingParams(logit_bias={5: 1.0})],
                       [[]], [[]])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        process_logits(mod(), np.zeros((1, 5), np.float32),
                       [SamplingParams(allowed_token_ids=[1, 5])], [[]], [[]])
