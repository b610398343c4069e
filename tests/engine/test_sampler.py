"""Sampler (runtime/sampler.py): greedy, seeds, vLLM's processing order (allowed tokens, bad
words, min_tokens, logit bias, penalties), logprobs modes, ranks and ties, awkward sizes and
extreme values. The seeded distribution tests of both samplers against an independent reference
of vLLM's rules live in test_sampling_distribution.py.

Tests draw fresh random logits each run; the seed entropy is printed (pytest shows it on
failure). Each test that follows a vLLM rule names the vLLM source in its docstring.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedrun.runtime import sampler as sampler_module
from pagedrun.runtime.outputs import TokenLogprobs
from pagedrun.runtime.sampler import (Sampler, apply_bans, apply_logits_processors,
                                      apply_penalties, filter_rows, log_softmax,
                                      make_request_generator, token_logprobs)
from pagedrun.runtime.sampling_params import SamplingParams

REPRODUCE_ENTROPY: int | None = None
DISTRIBUTION_SEED = 20261129


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


def test_request_generators_follow_vllm_seed_plus_j():
    """vllm/v1/engine/parallel_sampling.py ParentRequest: child j of a seeded request uses
    seed + j."""
    a = make_request_generator(7).random(4)
    np.testing.assert_array_equal(a, make_request_generator(7, 0).random(4))
    np.testing.assert_array_equal(make_request_generator(7, 2).random(4),
                                  np.random.Generator(np.random.PCG64(9)).random(4))
    assert not np.array_equal(a, make_request_generator(7, 1).random(4))
    assert make_request_generator(None) is None
    top = 2**64 - 1  # the largest seed SamplingParams takes; seed + j beyond it still works
    assert make_request_generator(top, 3).random() != make_request_generator(top, 4).random()


def test_top_p_candidate_growth_on_flat_distribution():
    """Nearly flat 5000-token vocabulary: top_p 0.9 needs thousands of candidates (the
    candidate set grows x4 from 64); the kept set is the full-sort definition's."""
    fixed = np.random.default_rng(DISTRIBUTION_SEED)
    logits = (fixed.standard_normal(5000) * 0.1).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    final, weights = filter_rows(logits[None], [params])
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    order = np.lexsort((np.arange(5000), -probs))
    before = np.cumsum(probs[order]) - probs[order]
    expected = np.zeros(5000, bool)
    expected[order[before < 0.9]] = True
    # float32 vs float64 mass may move the one boundary token
    assert np.count_nonzero((weights[0] > 0) != expected) <= 1
    assert 0.85 * 5000 < np.count_nonzero(weights[0]) < 0.95 * 5000
    assert np.array_equal(np.isfinite(final[0]), weights[0] > 0)
    tokens = run(Sampler(seed=1), np.repeat(logits[None], 300, axis=0), [params] * 300).token_ids
    assert (weights[0, tokens] > 0).all()


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


def test_logits_processors_follow_vllm_order(rng):
    """vllm/v1/sample/sampler.py Sampler.apply_logits_processors: allowed_token_ids mask, bad
    words (vllm/v1/sample/ops/bad_words.py), min_tokens and logit bias
    (vllm/v1/sample/logits_processor/builtin.py), then penalties
    (vllm/model_executor/layers/utils.py apply_penalties). Bias before penalties shows in the
    repetition penalty: it divides or multiplies the biased logit."""
    vocab, eos = 40, 0
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    logits[0, 5] = 1.0
    params = [
        # bias -2 turns logit 1 into -1, then repetition 2 multiplies: -2 (penalty first: -1.5)
        SamplingParams(logit_bias={5: -2.0, 6: 3.0}, repetition_penalty=2.0),
        # allowed list; a bias outside it stays -inf; a penalty inside applies
        SamplingParams(allowed_token_ids=[3, 9, 30], logit_bias={4: 50.0, 9: 1.0},
                       presence_penalty=0.5),
        # min_tokens bans stop ids and eos although ignore_eos; bias on a banned id stays -inf
        SamplingParams(min_tokens=4, stop_token_ids=[7], ignore_eos=True,
                       logit_bias={7: 80.0}),
        # bad words: [11] always; [12, 13, 14] when the output ends 12, 13; [15, 16] not
        SamplingParams(_bad_words_token_ids=[[11], [12, 13, 14], [15, 16], [1, 2, 3, 4, 17]]),
    ]
    prompts = [np.array([5], np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32),
               np.zeros(0, np.int32)]
    outputs = [[], [9], [2, 2], [12, 13]]
    got = logits.copy()
    apply_logits_processors(got, params, prompts, outputs, [eos])
    assert got[0, 5] == np.float32(-2.0)
    assert got[0, 6] == logits[0, 6] + np.float32(3.0)
    allowed = np.zeros(vocab, bool)
    allowed[[3, 9, 30]] = True
    assert np.isneginf(got[1, ~allowed]).all()
    assert got[1, 9] == logits[1, 9] + np.float32(1.0) - np.float32(0.5)
    assert got[1, 3] == logits[1, 3]
    assert np.isneginf(got[2, [eos, 7]]).all()
    assert np.isfinite(np.delete(got[2], [eos, 7])).all()
    assert np.isneginf(got[3, [11, 14]]).all()
    assert np.isfinite(np.delete(got[3], [11, 14])).all()
    # Greedy rows take the argmax after all of it.
    greedy = [SamplingParams(temperature=0.0, **{k: getattr(p, k) for k in (
        "logit_bias", "allowed_token_ids", "min_tokens", "stop_token_ids", "ignore_eos",
        "repetition_penalty", "presence_penalty", "_bad_words_token_ids")}) for p in params]
    out = run(Sampler([eos]), logits, greedy, prompts=prompts, outputs=outputs)
    np.testing.assert_array_equal(out.token_ids, got.argmax(axis=1))


def test_min_tokens_masks_eos_even_with_ignore_eos(rng):
    """vllm/v1/sample/logits_processor/builtin.py MinTokensLogitsProcessor: while
    len(output) < min_tokens, every stop token id gets -inf, eos included whatever ignore_eos
    says (vllm/sampling_params.py adds eos to _all_stop_token_ids)."""
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
    assert out.token_ids[2] not in (eos, 7)  # ignore_eos: eos still masked during min_tokens
    assert out.token_ids[3] not in (eos, 7)
    masked = logits.copy()
    apply_bans(masked, params, outputs, [eos])
    assert np.isneginf(masked[0, [eos, 7]]).all() and np.isfinite(masked[1]).all()
    assert np.isneginf(masked[2, [eos, 7]]).all()


def test_out_of_vocab_ids_never_index_past_the_vocabulary(rng):
    """The engine refuses these at admission; the sampler ignores them (no IndexError)."""
    logits = rng.standard_normal((1, 10)).astype(np.float32)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[10, 99],
                       logit_bias={12: 5.0, 3: 100.0}, allowed_token_ids=[3, 4, 10],
                       _bad_words_token_ids=[[50]], repetition_penalty=1.5)
    out = run(Sampler([1000]), logits, [p], prompts=[np.array([3, 11], np.int32)],
              outputs=[[20]])
    assert out.token_ids[0] == 3


# ------------------------------------------------------------------------------ logprobs

def reference_log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    finite = np.isfinite(x)
    out = np.full(x.shape, -np.inf)
    shifted = x[finite] - x[finite].max()
    out[finite] = shifted - np.log(np.exp(shifted).sum())
    return out


def check_entry(lp: TokenLogprobs, values: np.ndarray, token: int, num_top: int, atol: float):
    """lp against the definitions: value of token, rank = 1 + #strictly larger, top = the
    num_top largest, best first, ties to the lower id (a stable full sort)."""
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(values[token], abs=atol) or (
        np.isneginf(lp.logprob) and np.isneginf(values[token]))
    # A value within atol of the token's may land on either side of it in float32: the rank
    # is exact up to such near-ties, and no looser.
    surely_above = int(np.count_nonzero(values > values[token] + atol))
    maybe_above = int(np.count_nonzero(values > values[token] - atol))
    assert 1 + surely_above <= lp.rank <= 1 + maybe_above
    num_top = values.size if num_top == -1 else num_top
    best = np.argsort(-values, kind="stable")[:num_top]
    top = np.array(lp.top_token_ids, dtype=np.int64)
    assert top.size == best.size and np.unique(top).size == top.size
    # The k best by the reference's float64 values (a near-tie may swap in float32) ...
    np.testing.assert_allclose(values[top], values[best], atol=atol)
    np.testing.assert_allclose(lp.top_logprobs, values[top], atol=atol)
    # ... in the sampler's own order: non-increasing, equal values by ascending id.
    got = np.array(lp.top_logprobs)
    assert all(a > b or (a == b and i < j) for a, b, i, j in zip(got, got[1:], top, top[1:]))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_logprobs_modes(rng, mode):
    """vllm/v1/sample/sampler.py Sampler.forward (logprobs_mode) and gather_logprobs: raw
    values are the model's logits (or their log_softmax); processed ones come after every
    processor and filter, filtered tokens at -inf (greedy rows: after the processors only).
    Ranks and tops are computed on the chosen values."""
    vocab, rows = 4099, 7
    logits = (rng.standard_normal((rows, vocab)) * 5).astype(np.float32)
    params = [SamplingParams(temperature=0.6, top_k=3, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.5, logprobs=20, seed=3),
              SamplingParams(temperature=0.0, logprobs=1, presence_penalty=2.0),
              SamplingParams(temperature=2.0, min_p=0.2, logprobs=2,
                             allowed_token_ids=list(range(0, vocab, 3))),
              SamplingParams(temperature=0.5, logprobs=-1, min_tokens=1, stop_token_ids=[4])]
    gens = [make_request_generator(p.seed) for p in params]
    outputs = [[int(logits[i].argmax())] for i in range(rows)]
    outputs[6] = []
    prompts = [np.array([int(logits[i].argmax())], np.int32) for i in range(rows)]
    out = run(Sampler(seed=4, logprobs_mode=mode), logits, params, gens, prompts, outputs)
    processed = logits.copy()
    apply_logits_processors(processed, params, prompts, outputs, [])
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        token = int(out.token_ids[i])
        if mode.startswith("raw"):
            values = logits[i].astype(np.float64)
        elif p.greedy:
            values = processed[i].astype(np.float64)
        else:
            # the filters' result, checked against their definitions in
            # test_sampling_distribution.py; here: what is kept is what may be drawn
            final, weights = filter_rows(processed[i:i + 1], [p])
            values = final[0].astype(np.float64)
            assert np.array_equal(np.isfinite(values), weights[0] > 0)
            np.testing.assert_array_equal(values[np.isfinite(values)],
                                          (processed[i] / np.float32(p.temperature))[
                                              np.isfinite(values)])
            assert np.isfinite(values[token])
        if mode.endswith("logprobs"):
            values = reference_log_softmax(values)
        check_entry(lp, values, token, p.logprobs, atol=2e-5)
    if mode == "processed_logprobs":
        assert out.logprobs[0].top_logprobs[3:] == [-np.inf, -np.inf]  # top_k 3: the rest -inf
        assert out.token_ids[1] == 7 and out.logprobs[1].rank == 1


def test_token_logprobs_ranks_and_ties():
    """vllm/v1/engine/logprobs.py LogprobsProcessor / sampler.py gather_logprobs: rank = 1 +
    the number of strictly larger values (tied tokens share a rank); the top-k best first,
    ties to the lower id, also when the tie straddles the k boundary."""
    row = np.array([0.5, 2.0, 1.0, 2.0, 1.0, 1.0, -np.inf, 1.0], np.float32)
    lp = token_logprobs(row, 5, 3)
    assert (lp.token_id, lp.logprob, lp.rank) == (5, 1.0, 3)
    assert lp.top_token_ids == [1, 3, 2] and lp.top_logprobs == [2.0, 2.0, 1.0]
    assert token_logprobs(row, 3, 0).rank == 1 and token_logprobs(row, 3, 0).top_token_ids == []
    assert token_logprobs(row, 6, 2).rank == 8
    whole = token_logprobs(row, 0, -1)
    assert whole.top_token_ids == [1, 3, 2, 4, 5, 7, 0, 6] and whole.rank == 7
    assert token_logprobs(row, 0, 100).top_token_ids == whole.top_token_ids
    # many ties at the boundary of a large row: the lowest ids win
    big = np.zeros(10_000, np.float32)
    big[[9000, 20]] = 1.0
    assert token_logprobs(big, 5, 4).top_token_ids == [20, 9000, 0, 1]


def test_log_softmax_without_nans():
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf] * 3, [np.inf, 0.0, np.nan]], np.float32)
    out = log_softmax(x)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out[0], reference_log_softmax(x[0]), atol=1e-6)
    assert np.isneginf(out[1]).all()
    assert out[2, 0] == 0.0 and np.isneginf(out[2, 2])


# ------------------------------------------------------------------------------ edges

@pytest.mark.parametrize("vocab", (1, 17, 111))
def test_awkward_sizes_and_extreme_params(rng, vocab):
    """Every filter at its extreme on small vocabularies: tokens stay in range, logprobs have
    no NaN, a row whose every token is masked gets token 0."""
    extremes = [dict(temperature=0.01, top_k=1), dict(temperature=2.0, top_p=1e-6),
                dict(temperature=2.0, min_p=1.0), dict(temperature=1.0, top_k=vocab + 5),
                dict(temperature=0.01, repetition_penalty=0.01, frequency_penalty=2.0,
                     presence_penalty=-2.0),
                dict(temperature=2.0, logit_bias={0: 100.0, vocab - 1: -100.0}),
                dict(temperature=0.7, top_k=3, top_p=0.3, min_p=0.5),
                dict(temperature=0.0, repetition_penalty=0.01),
                dict(temperature=1.0, allowed_token_ids=[vocab - 1], min_tokens=2,
                     stop_token_ids=[vocab - 1])]  # every token masked
    params = [SamplingParams(logprobs=2, **kw) for kw in extremes]
    rows = len(params)
    logits = (rng.standard_normal((rows, vocab)) * 30).astype(np.float32)
    logits[4] = 3e38
    logits[5] /= 30  # so that the +100 bias decides the row
    prompts = [rng.integers(0, vocab, 4).astype(np.int32) for _ in range(rows)]
    outputs = [rng.integers(0, vocab, 3).tolist() for _ in range(rows)]
    outputs[-1] = []
    for mode in ("raw_logprobs", "processed_logprobs", "processed_logits"):
        out = run(Sampler(seed=5, logprobs_mode=mode), logits, params, None, prompts, outputs)
        assert out.token_ids.dtype == np.int32
        assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()
        assert out.token_ids[-1] == 0
        for lp in out.logprobs:
            assert not np.isnan(lp.logprob) and not np.isnan(lp.top_logprobs).any()
            assert len(lp.top_token_ids) == min(2, vocab)
    if vocab > 1:
        assert out.token_ids[5] == 0  # +100 against |logits| < ~5, at temperature 2


def test_rejects_mismatched_lengths_and_unknown_modes():
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 5), np.float32), [SamplingParams()], [None], [[]], [[]])
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="logprobs")
