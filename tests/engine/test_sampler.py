"""Sampler: greedy, seeded reproducibility, exact truncated distributions, penalties, logprobs.

Distribution tests use a fixed seed (deterministic) and a chi-square bound at 1e-6 one-sided
significance: a correct sampler would fail it for fewer than one seed in a million. Support is
checked exactly (no draw outside the truncated set). Other tests draw fresh random logits each
run; the seed entropy is printed (pytest shows it on failure).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedrun.runtime.outputs import Logprob
from pagedrun.runtime import sampler as sampler_module
from pagedrun.runtime.sampler import (Sampler, apply_min_tokens, apply_penalties,
                                      make_request_generator)
from pagedrun.runtime.sampling_params import SamplingParams

REPRODUCE_ENTROPY: int | None = None
DISTRIBUTION_SEED = 20261129
NUM_DRAWS = 12000
# Standard normal quantile for one-sided 1e-6.
Z_ONE_IN_A_MILLION = 4.7534


@pytest.fixture
def rng() -> np.random.Generator:
    seq = np.random.SeedSequence(REPRODUCE_ENTROPY)
    print(f"numpy SeedSequence entropy={seq.entropy}")
    return np.random.default_rng(seq)


def run(sampler, logits, params, generators=None, prompts=None, outputs=None):
    n = logits.shape[0]
    return sampler.sample(logits, params, generators or [None] * n,
                          prompts or [np.zeros(0, np.int32)] * n, outputs or [[] for _ in range(n)])


# ------------------------------------------------------------------------------ greedy

def test_greedy_is_argmax_lowest_id_on_ties(rng):
    vocab = 1000
    logits = rng.standard_normal((17, vocab)).astype(np.float32)
    logits[3, [10, 500, 999]] = 50.0  # tie: the lowest id wins
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5) for _ in range(17)]
    out = run(Sampler(), logits, params)
    assert out.token_ids.dtype == np.int32
    for i in range(17):
        row = logits[i].tolist()
        assert out.token_ids[i] == row.index(max(row))
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 17


# ------------------------------------------------------------------------------ seeds

def test_seeded_request_reproducible_across_batches(rng):
    vocab, num_steps = 300, 12
    step_logits = [rng.standard_normal(vocab).astype(np.float32) * 2 for _ in range(num_steps)]
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def generate(batch_size, row, sampler_seed):
        sampler = Sampler(seed=sampler_seed)
        gen = make_request_generator(target.seed)
        tokens = []
        for step in range(num_steps):
            logits = rng.standard_normal((batch_size, vocab)).astype(np.float32)
            logits[row] = step_logits[step]
            params = [SamplingParams(temperature=1.0) for _ in range(batch_size)]
            params[row] = target
            gens = [None] * batch_size
            gens[row] = gen
            if batch_size > 2:  # another seeded request in the batch
                other = (row + 1) % batch_size
                params[other] = SamplingParams(temperature=0.5, seed=99)
                gens[other] = make_request_generator(99)
            tokens.append(int(run(sampler, logits, params, gens).token_ids[row]))
        return tokens

    alone = generate(1, 0, 0)
    assert generate(7, 4, 5) == alone
    assert generate(33, 32, 11) == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=1235)
    target = other_seed
    assert generate(1, 0, 0) != alone  # 12 tokens over ~100 plausible ids: collision ~impossible


def test_request_generators_independent_streams():
    a = make_request_generator(7).random(4)
    np.testing.assert_array_equal(a, make_request_generator(7, 0).random(4))
    assert not np.array_equal(a, make_request_generator(7, 1).random(4))
    assert make_request_generator(None) is None


# ------------------------------------------------------------------------------ distributions

def exact_distribution(logits, p: SamplingParams):
    """Float64 reference: full sort of the vocabulary, each filter written from its definition."""
    x = logits.astype(np.float64) / p.temperature
    vocab = x.shape[0]
    keep = np.ones(vocab, dtype=bool)
    if p.top_k > 0:
        kth = sorted(x, reverse=True)[min(p.top_k, vocab) - 1]
        keep &= x >= kth
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = sorted(range(vocab), key=lambda t: (-probs[t], t))
        mass, top_p_keep = 0.0, np.zeros(vocab, dtype=bool)
        for t in order:
            if probs[t] == 0.0 or mass >= p.top_p:
                break
            top_p_keep[t] = True
            mass += probs[t]
        probs = np.where(top_p_keep, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


def chi_square_bound(dof: int) -> float:
    """Wilson-Hilferty chi-square quantile at 1 - 1e-6."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + Z_ONE_IN_A_MILLION * math.sqrt(c)) ** 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.08),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
], ids=["temperature", "top_k", "top_p", "min_p", "all"])
def test_empirical_distribution_matches_truncated(params):
    vocab = 200  # > TOP_P_FIRST_CANDIDATES so the candidate set has to grow for top_p
    fixed = np.random.default_rng(DISTRIBUTION_SEED)
    logits = (fixed.standard_normal(vocab) * 1.5).astype(np.float32)
    logits[:5] += 3.0  # a few dominant tokens, a long tail
    batch = np.repeat(logits[None, :], NUM_DRAWS, axis=0)
    sampler = Sampler(seed=DISTRIBUTION_SEED)
    tokens = run(sampler, batch, [params] * NUM_DRAWS).token_ids
    counts = np.bincount(tokens, minlength=vocab)
    expected = exact_distribution(logits, params)
    support = expected > 0
    assert counts[~support].sum() == 0, np.flatnonzero(counts * ~support)
    expected_counts = expected[support] * NUM_DRAWS
    chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    dof = int(support.sum()) - 1
    if dof > 0:
        assert chi2 < chi_square_bound(dof), (chi2, dof)


def test_top_p_candidate_growth_on_flat_distribution():
    """Nearly flat 5000-token vocabulary: top_p 0.9 needs thousands of candidates."""
    fixed = np.random.default_rng(DISTRIBUTION_SEED)
    logits = (fixed.standard_normal(5000) * 0.1).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    tokens = run(Sampler(seed=1), np.repeat(logits[None], 300, axis=0), [params] * 300).token_ids
    expected = exact_distribution(logits, params)
    assert expected[tokens].min() > 0
    assert 0.85 * 5000 < np.count_nonzero(expected) < 0.95 * 5000


def chi_square_binned(counts, expected, num_draws):
    """Chi-square over tokens expected >= 5 times, the rest pooled into one bin (np.int counts)."""
    big = expected * num_draws >= 5
    observed = np.append(counts[big], counts[~big].sum())
    want = np.append(expected[big], expected[~big].sum()) * num_draws
    used = want > 0
    return float(((observed[used] - want[used]) ** 2 / want[used]).sum()), int(used.sum()) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.9, top_k=40),
    SamplingParams(temperature=1.1, top_p=0.8, min_p=0.01),
], ids=["temperature", "top_k", "top_p_min_p"])
def test_empirical_distribution_large_vocab(params):
    """5000 tokens: several inverse-CDF chunks (the last partial) and the chunk-max candidate
    filter of top-k / top-p; heavy tokens spread over every chunk."""
    vocab, num_draws = 5000, 6000
    assert vocab > 4 * sampler_module.CDF_CHUNK and vocab % sampler_module.CDF_CHUNK
    fixed = np.random.default_rng(DISTRIBUTION_SEED + 1)
    logits = (fixed.standard_normal(vocab) - 4.0).astype(np.float32)
    heavy = fixed.choice(vocab, size=60, replace=False)
    logits[heavy] = (fixed.standard_normal(60) * 1.5 + 2.0).astype(np.float32)
    logits[vocab - 1] = 3.0  # the very last token (partial last chunk) is a likely one
    tokens = run(Sampler(seed=DISTRIBUTION_SEED), np.repeat(logits[None], num_draws, axis=0),
                 [params] * num_draws).token_ids
    counts = np.bincount(tokens, minlength=vocab)
    expected = exact_distribution(logits, params)
    assert counts[expected == 0].sum() == 0
    chi2, dof = chi_square_binned(counts, expected, num_draws)
    assert chi2 < chi_square_bound(dof), (chi2, dof)


def test_heaviest_finds_the_largest_entries(rng):
    for vocab, count in [(5000, 1), (5000, 64), (5000, 77), (1000, 900), (130, 64), (64, 64)]:
        row = rng.standard_normal(vocab).astype(np.float32)
        row[rng.choice(vocab, size=vocab // 3, replace=False)] = -np.inf
        row[rng.choice(vocab, size=10, replace=False)] = 1.5  # ties
        got = sampler_module._heaviest(row, count)
        assert got.size == min(count, vocab) and np.unique(got).size == got.size
        np.testing.assert_array_equal(np.sort(row[got]), np.sort(row)[vocab - got.size:])


# --------------------------------------------------------------------------- penalties, min_tokens

def penalized_reference(logits, p: SamplingParams, prompt, output):
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in range(out.shape[0]):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count
        if count:
            out[t] -= p.presence_penalty
    return out


def test_penalties_match_per_token_reference(rng):
    vocab, rows = 97, 9
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params, prompts, outputs = [], [], []
    for i in range(rows):
        params.append(SamplingParams(
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.7])),
            frequency_penalty=float(rng.uniform(-2, 2)) if i % 3 else 0.0,
            presence_penalty=float(rng.uniform(-2, 2)) if i % 2 else 0.0))
        prompts.append(rng.integers(0, vocab, size=int(rng.integers(1, 40))).astype(np.int32))
        outputs.append(rng.integers(0, vocab, size=int(rng.integers(0, 30))).tolist())
    processed = logits.copy()
    apply_penalties(processed, params, prompts, outputs)
    for i in range(rows):
        ref = penalized_reference(logits[i], params[i], prompts[i].tolist(), outputs[i])
        np.testing.assert_allclose(processed[i], ref, rtol=1e-6, atol=1e-5)
    # End to end: greedy rows pick the argmax of the penalized logits.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty) for p in params]
    out = run(Sampler(), logits, greedy, prompts=prompts, outputs=outputs)
    np.testing.assert_array_equal(out.token_ids, processed.argmax(axis=1))


def test_min_tokens_masks_eos_and_stop_ids(rng):
    vocab, eos = 50, 2
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    logits[:, [eos, 7]] = 100.0  # eos and a stop id dominate
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),
              SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[7])]
    outputs = [[1, 1], [1, 1, 1], [], [4]]
    out = run(Sampler(eos_token_ids=[eos]), logits, params, outputs=outputs)
    assert out.token_ids[0] not in (eos, 7)
    assert out.token_ids[1] == eos  # min_tokens reached: eos allowed (lowest id of the tie)
    assert out.token_ids[2] == eos  # ignore_eos: eos is not a stop token, so not masked
    assert out.token_ids[3] not in (eos, 7)
    masked = logits.copy()
    apply_min_tokens(masked, params, outputs, [eos])
    assert np.isneginf(masked[0, [eos, 7]]).all() and np.isfinite(masked[1]).all()


# ------------------------------------------------------------------------------ logprobs

def test_logprobs_are_raw_log_softmax(rng):
    vocab, rows = 4099, 6
    logits = (rng.standard_normal((rows, vocab)) * 5).astype(np.float32)
    params = [SamplingParams(temperature=0.6, top_k=3, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.5, logprobs=20, seed=3),
              SamplingParams(temperature=0.0, logprobs=1, presence_penalty=2.0),
              SamplingParams(temperature=2.0, min_p=0.2, logprobs=2)]
    gens = [make_request_generator(p.seed) for p in params]
    outputs = [[int(logits[i].argmax())] for i in range(rows)]
    prompts = [np.array([int(logits[i].argmax())], np.int32) for i in range(rows)]
    out = run(Sampler(seed=4), logits, params, gens, prompts, outputs)
    x = logits.astype(np.float64)
    ref = x - x.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        assert isinstance(lp, Logprob) and lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - ref[i, lp.token_id]) < 1e-5
        best = np.argsort(-ref[i], kind="stable")[:p.logprobs]
        assert list(lp.top) == best.tolist()
        for t, v in lp.top.items():
            assert abs(v - ref[i, t]) < 1e-5


def test_rejects_mismatched_lengths(rng):
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 5), np.float32), [SamplingParams()], [None], [[]], [[]])
