"""Rejection sampling for speculative decoding (issue 17): runtime/spec_decode/rejection_sampler.py
and target_probs.py.

Two links make "speculation samples what the plain sampler samples":
1. target_probs.processed_weights is the distribution runtime/sampler.Sampler draws from: for
   the same uniform, the Sampler's token is the inverse CDF of those weights (checked here with
   a plain float64 cumsum, nothing shared with the sampler's two-level draw); with no draft
   tokens, the rejection sampler's output is the Sampler's, bit for bit, same seeds.
2. Given those weights, the tokens emitted with speculation are distributed as if drawn one by
   one from them: the distribution tests below.

Distribution tests. A "model" is a table: the logits of the next token depend only on the last
token (VOCAB_SIZE x VOCAB_SIZE), so the processed weights of every history are one table lookup
(the sampling modes used here have no history-dependent processor). The target and the draft
model have different tables. NUM_TRIALS independent requests start from START and run
speculative steps (k_b uniform in 1..K per request and step, proposals from the draft model,
q = its processed distribution; or n-gram-like fixed proposals, q = point mass) until two tokens
are emitted. Compared: the empirical distribution of the first token (VOCAB_SIZE bins) and of
the first two tokens (VOCAB_SIZE^2 bins) with what the plain sampler would draw,
p(t1) and p(t1) p(t2 | t1).

The statistic is total variation, TV = 1/2 sum_b |n_b / n - p_b| = max over sets A of bins of
(n_A / n - p_A). Bound, derived from the sample size n and the number of bins K: for one fixed
set A, n_A is a sum of n independent 0/1 draws with mean p_A, so Hoeffding gives
P(n_A / n - p_A > t) <= exp(-2 n t^2); a union bound over the 2^K sets gives
P(TV > t) <= 2^K exp(-2 n t^2). Setting that to FAILURE_PROBABILITY = 1e-6:

    t(n, K) = sqrt((K ln 2 + ln(1 / 1e-6)) / (2 n)).

n = 30000: t = 0.018 for K = 8, 0.031 for K = 64. (The trials are independent: every request
draws its own uniforms and its own draft tokens. The draws are seeded, so each case is
deterministic; the bound says a failing seed is a one-in-a-million event for a correct
sampler.) Exactly, too: no emitted token (pair) may have probability zero.
Greedy is checked exactly: every request emits the target's argmax chain.

Power (the test can fail): planted bugs, monkeypatched into the module, and for each the
first-token distribution it produces, computed in closed form, is farther than 2 t from p (so
with probability >= 1 - 1e-6 its draws are farther than t), and the statistic rejects it:
- resample from p instead of the residual max(0, p - q): emits min(p, q) + (1 - sum min(p, q)) p
  (n-gram, point mass on x: p(x) [t = x] + (1 - p(x)) p);
- accept ignoring q (accept x with probability p(x), residual still max(0, p - q)): emits
  q p + (sum_x q(x) (1 - p(x))) residual.
(Accepting when u < p/q without the min(1, .) is the same rule, so it is not a bug to plant.)
Run time: about 10 s on 2 cores.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedrun.runtime.sampler import Sampler, make_request_generator
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.spec_decode import rejection_sampler as rs
from pagedrun.runtime.spec_decode.rejection_sampler import (PLACEHOLDER_TOKEN_ID,
                                                            draw_spec_uniforms,
                                                            rejection_sample)
from pagedrun.runtime.spec_decode.target_probs import (normalize, processed_weights,
                                                       verification_weights)

FAILURE_PROBABILITY = 1e-6
VOCAB_SIZE = 8
K = 3                  # the most draft tokens per step
NUM_TRIALS = 30_000    # ~0.8 s per case on 2 cores, mostly the sampler's inverse CDF
START = 1              # every request's prompt
EOS = 0
TABLE_SEED = 17

MODES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(top_k=3),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.1),
    "greedy": SamplingParams(temperature=0.0),
}


def tv_bound(num_samples: int, num_bins: int) -> float:
    return math.sqrt((num_bins * math.log(2) + math.log(1 / FAILURE_PROBABILITY))
                     / (2 * num_samples))


def total_variation(samples: np.ndarray, expected: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=expected.size)
    return 0.5 * float(np.abs(counts / samples.size - expected).sum())


# ------------------------------------------------------------------------- the tiny models

def logit_tables() -> tuple[np.ndarray, np.ndarray]:
    """(target, draft) logits [VOCAB_SIZE (last token), VOCAB_SIZE] float32: the draft is the
    target plus noise, so it agrees often but not always."""
    rng = np.random.default_rng(TABLE_SEED)
    target = rng.normal(0.0, 1.0, (VOCAB_SIZE, VOCAB_SIZE)).astype(np.float32)
    draft = (target + rng.normal(0.0, 1.0, target.shape)).astype(np.float32)
    return target, draft


def weight_table(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[VOCAB_SIZE, VOCAB_SIZE] float32: row = last token, the processed weights after it."""
    rows = logits.shape[0]
    return processed_weights(logits, [params] * rows, [np.array([START])] * rows, [[]] * rows,
                             [EOS])


def ngram_proposals(target_logits: np.ndarray) -> np.ndarray:
    """[VOCAB_SIZE]: the fixed token proposed after each token: the target's best or second
    best by raw logits (half each), the second after START (a token of moderate probability,
    where the planted bugs show)."""
    order = np.argsort(-target_logits, axis=1, kind="stable")
    pick = np.random.default_rng(TABLE_SEED + 1).integers(0, 2, VOCAB_SIZE)
    proposals = order[np.arange(VOCAB_SIZE), pick]
    proposals[START] = order[START, 1]
    return proposals


def speculative_runs(p_table: np.ndarray, q_table: np.ndarray, proposer: str,
                     params: SamplingParams, num_trials: int, seed: int,
                     starts: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """(first two emitted tokens [num_trials, 2], accepted draft tokens, rejections) of
    num_trials requests from START (or from starts [num_trials]). proposer "draft": x_i drawn
    from q_table[previous token], q = those rows; "ngram": x_i = ngram_proposals()[previous],
    q = None (point mass)."""
    rng = np.random.default_rng(seed)
    engine = np.random.Generator(np.random.PCG64(seed + 1))
    target_logits, _ = logit_tables()
    proposals = ngram_proposals(target_logits)
    q_cdf = np.cumsum(normalize(q_table), axis=1)
    first_two = np.full((num_trials, 2), -1, dtype=np.int64)
    count = np.zeros(num_trials, dtype=np.int64)
    last = np.full(num_trials, START, dtype=np.int64) if starts is None else starts.copy()
    active = np.arange(num_trials)
    num_accepted = num_rejected = 0
    while active.size:
        m = active.size
        num_draft = rng.integers(1, K + 1, size=m)
        context = np.empty((m, K + 1), dtype=np.int64)  # the last token before position i
        context[:, 0] = last[active]
        for i in range(K):
            prev = context[:, i]
            if proposer == "draft":
                x = (rng.random(m)[:, None] >= q_cdf[prev]).sum(axis=1)
                context[:, i + 1] = np.minimum(x, VOCAB_SIZE - 1)
            else:
                context[:, i + 1] = proposals[prev]
        draft = context[:, 1:]
        q = q_table[context[:, :K]] if proposer == "draft" else None
        uniforms = draw_spec_uniforms(engine, [params] * m, [None] * m, num_draft)
        out = rejection_sample(p_table[context], draft, num_draft, q,
                               np.full(m, params.greedy), uniforms)
        num_accepted += int(out.num_accepted.sum())
        num_rejected += int((out.num_accepted < num_draft).sum())
        for j in range(K + 1):
            take = (j < out.num_emitted) & (count[active] < 2)
            rows = active[take]
            first_two[rows, count[rows]] = out.token_ids[take, j]
            count[rows] += 1
        last[active] = out.token_ids[np.arange(m), out.num_emitted - 1]
        active = active[count[active] < 2]
    return first_two, num_accepted, num_rejected


def expected_distributions(p_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p(t1) [V], p(t1, t2) [V * V] flattened t1 * V + t2) of the plain sampler."""
    p = normalize(p_table)
    return p[START], (p[START][:, None] * p).reshape(-1)


def distances(first_two: np.ndarray, p_table: np.ndarray) -> tuple[float, float]:
    first, pair = expected_distributions(p_table)
    pairs = first_two[:, 0] * VOCAB_SIZE + first_two[:, 1]
    assert (first[first_two[:, 0]] > 0).all(), "a first token of probability zero"
    return total_variation(first_two[:, 0], first), total_variation(pairs, pair)


def tables_for(mode: str) -> tuple[np.ndarray, np.ndarray]:
    target_logits, draft_logits = logit_tables()
    return weight_table(target_logits, MODES[mode]), weight_table(draft_logits, MODES[mode])


# ------------------------------------------------------------------------- distribution

@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("mode", ["temperature", "top_k", "top_p", "min_p"])
def test_speculation_keeps_the_target_distribution(mode, proposer):
    p_table, q_table = tables_for(mode)
    seed = 1000 + 10 * list(MODES).index(mode) + (proposer == "ngram")
    first_two, num_accepted, num_rejected = speculative_runs(
        p_table, q_table, proposer, MODES[mode], NUM_TRIALS, seed)
    assert num_accepted > NUM_TRIALS // 10 and num_rejected > NUM_TRIALS // 10  # not vacuous
    tv_first, tv_pair = distances(first_two, p_table)
    _, pair = expected_distributions(p_table)
    pairs = first_two[:, 0] * VOCAB_SIZE + first_two[:, 1]
    assert (pair[pairs] > 0).all(), "a token pair of probability zero"
    assert tv_first <= tv_bound(NUM_TRIALS, VOCAB_SIZE), (mode, proposer, tv_first)
    assert tv_pair <= tv_bound(NUM_TRIALS, VOCAB_SIZE ** 2), (mode, proposer, tv_pair)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_greedy_emits_the_argmax_chain(proposer):
    p_table, q_table = tables_for("greedy")
    target_logits, _ = logit_tables()
    starts = np.arange(200) % VOCAB_SIZE  # every prompt token, k_b varying
    g1 = np.argmax(target_logits[starts], axis=1)
    g2 = np.argmax(target_logits[g1], axis=1)
    first_two, num_accepted, num_rejected = speculative_runs(
        p_table, q_table, proposer, MODES["greedy"], starts.size, seed=5, starts=starts)
    assert num_accepted > 0 and num_rejected > 0
    np.testing.assert_array_equal(first_two, np.stack([g1, g2], axis=1))


def planted_first_token(bug: str, proposer: str, p: np.ndarray, q: np.ndarray,
                        proposal: int) -> np.ndarray:
    """The closed-form first-token distribution of a planted bug (module docstring)."""
    if proposer == "ngram":
        q = np.eye(p.size)[proposal]
    overlap = np.minimum(p, q)
    residual = np.maximum(p - q, 0.0)
    if bug == "resample_from_p":
        return overlap + (1 - overlap.sum()) * p
    return q * p + float((q * (1 - p)).sum()) * residual / residual.sum()


PLANTS = {
    "resample_from_p": ("residual_weights", lambda p, q: p.copy()),
    "accept_ignoring_q": ("accepted", lambda u, p_x, q_x: u < p_x),
}


@pytest.mark.parametrize("bug,proposer,mode", [("resample_from_p", "draft", "temperature"),
                                               ("resample_from_p", "ngram", "temperature"),
                                               ("accept_ignoring_q", "draft", "top_p")])
def test_planted_bugs_are_rejected(bug, proposer, mode, monkeypatch):
    p_table, q_table = tables_for(mode)
    target_logits, _ = logit_tables()
    p = normalize(p_table)[START]
    wrong = planted_first_token(bug, proposer, p, normalize(q_table)[START],
                                int(ngram_proposals(target_logits)[START]))
    bound = tv_bound(NUM_TRIALS, VOCAB_SIZE)
    assert 0.5 * np.abs(wrong - p).sum() > 2 * bound  # the case has power
    name, planted = PLANTS[bug]
    monkeypatch.setattr(rs, name, planted)
    first_two, _, _ = speculative_runs(p_table, q_table, proposer, MODES[mode], NUM_TRIALS,
                                       seed=77)
    first = first_two[:, 0]
    assert total_variation(first, p) > bound
    # The joint of two tokens is at least as far (a marginal never moves farther apart).
    assert distances(first_two, p_table)[1] > tv_bound(NUM_TRIALS, VOCAB_SIZE ** 2)
    # The closed form is what the planted code does (it is the right thing to test against).
    assert total_variation(first, wrong) <= bound


# ------------------------------------------------------------------------- the sampler link

SAMPLER_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=20, temperature=1.3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.05, top_p=0.9),
    SamplingParams(temperature=0.0),
    SamplingParams(logit_bias={5: 4.0}, allowed_token_ids=list(range(0, 3000, 7)) + [5]),
    SamplingParams(min_tokens=3, stop_token_ids=[9], repetition_penalty=1.3,
                   frequency_penalty=0.5),
]


def sampler_case(vocab_size: int = 3000, seeds_per_params: int = 48):
    rng = np.random.default_rng(3)
    base = rng.normal(0.0, 2.0, vocab_size).astype(np.float32)
    params, seeds = [], []
    for j, p in enumerate(SAMPLER_PARAMS):
        params += [p] * seeds_per_params
        seeds += list(range(100 * j, 100 * j + seeds_per_params))
    rows = len(params)
    logits = np.tile(base, (rows, 1))
    prompts = [np.array([9, 11, 5])] * rows
    outputs = [[11, 11, 42]] * rows
    return logits, params, seeds, prompts, outputs


def test_processed_weights_are_what_the_sampler_draws():
    logits, params, seeds, prompts, outputs = sampler_case()
    tokens = Sampler(eos_token_ids=[EOS]).sample(
        logits, params, [make_request_generator(s) for s in seeds], prompts, outputs).token_ids
    probs = normalize(processed_weights(logits, params, prompts, outputs, [EOS]))
    cdf = np.cumsum(probs, axis=1)
    for i, seed in enumerate(seeds):
        if params[i].greedy:
            assert probs[i, tokens[i]] == 1.0
            continue
        u = make_request_generator(seed).random()
        assert tokens[i] == int(np.searchsorted(cdf[i], u, side="right")), i
    assert len(set(tokens.tolist())) > 20  # the seeds really spread


def test_without_draft_tokens_it_is_the_plain_sampler_bit_for_bit():
    logits, params, seeds, prompts, outputs = sampler_case(vocab_size=2500)
    seeded = [s if i % 3 else None for i, s in enumerate(seeds)]  # every third: the engine's
    sampler = Sampler(eos_token_ids=[EOS], seed=8)
    want = sampler.sample(logits, params, [make_request_generator(s) for s in seeded], prompts,
                          outputs).token_ids
    rows = len(params)
    uniforms = draw_spec_uniforms(np.random.Generator(np.random.PCG64(8)), params,
                                  [make_request_generator(s) for s in seeded], [0] * rows)
    weights = processed_weights(logits, params, prompts, outputs, [EOS])
    out = rejection_sample(weights[:, None, :], np.zeros((rows, 0), dtype=np.int64),
                           np.zeros(rows, dtype=np.int64), None,
                           np.array([p.greedy for p in params]), uniforms)
    assert (out.num_emitted == 1).all()
    np.testing.assert_array_equal(out.token_ids[:, 0], want)


# ------------------------------------------------------------------------- worked examples

def one_request(p_rows, draft, u, q_rows=None, greedy=False):
    p = np.asarray(p_rows, dtype=np.float32)[None]
    q = None if q_rows is None else np.asarray(q_rows, dtype=np.float32)[None]
    return rejection_sample(p, np.array([draft]), np.array([len(draft)]), q,
                            np.array([greedy]), np.array([u], dtype=np.float64))


def test_worked_example_point_mass():
    p0, p1 = [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]
    # Accept x = 1 iff u_0 < p(1) = 0.3; then the bonus from p1 by u_1.
    out = one_request([p0, p1], [1], [0.29, 0.05])
    assert out.emitted(0).tolist() == [1, 0] and out.num_accepted.tolist() == [1]
    assert one_request([p0, p1], [1], [0.29, 0.5]).emitted(0).tolist() == [1, 2]
    # Rejected: residual p0 without token 1 = [0.5, 0, 0.2] / 0.7; u = 0.5 -> 0.35 < 0.5: 0.
    out = one_request([p0, p1], [1], [0.31, 0.5])
    assert out.emitted(0).tolist() == [0] and out.num_accepted.tolist() == [0]
    assert out.token_ids.tolist() == [[0, PLACEHOLDER_TOKEN_ID]]
    # u = 0.8 -> 0.56 >= 0.5: token 2 (never 1, which the residual excludes).
    assert one_request([p0, p1], [1], [0.31, 0.8]).emitted(0).tolist() == [2]


def test_worked_example_draft_distribution():
    p0, p1 = [0.5, 0.3, 0.2], [0.0, 1.0, 0.0]
    q0 = [0.2, 0.6, 0.2]
    # x = 1: accept with probability p / q = 0.5.
    assert one_request([p0, p1], [1], [0.49, 0.0], [q0]).emitted(0).tolist() == [1, 1]
    # Rejected: residual max(0, p - q) = [0.3, 0, 0] -> always token 0.
    assert one_request([p0, p1], [1], [0.51, 0.99], [q0]).emitted(0).tolist() == [0]
    # x = 0: p / q = 2.5, always accepted.
    assert one_request([p0, p1], [0], [0.999, 0.3], [q0]).num_accepted.tolist() == [1]
    # p == q: never rejected, and an empty residual would fall back to p.
    assert one_request([q0, p1], [2], [0.999, 0.3], [q0]).num_accepted.tolist() == [1]


def test_greedy_ignores_uniforms_and_draws_nothing():
    p = [[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]
    nan = [np.nan, np.nan, np.nan]
    assert one_request(p, [1, 0], nan, greedy=True).emitted(0).tolist() == [1, 0, 2]
    assert one_request(p, [1, 2], nan, greedy=True).emitted(0).tolist() == [1, 0]
    assert one_request(p, [2, 0], nan, greedy=True).emitted(0).tolist() == [1]
    engine = np.random.Generator(np.random.PCG64(4))
    own = make_request_generator(9)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=9)]
    uniforms = draw_spec_uniforms(engine, params, [None, own], [3, 2])
    assert uniforms.shape == (2, 4) and not uniforms.any()
    assert engine.random() == np.random.Generator(np.random.PCG64(4)).random()
    assert own.random() == make_request_generator(9).random()


def test_seeded_requests_do_not_depend_on_the_batch():
    p_table, q_table = tables_for("temperature")
    params = SamplingParams(temperature=0.8, seed=123)

    def run(batch_size: int, position: int):
        rng = np.random.default_rng(batch_size)
        draft = rng.integers(0, VOCAB_SIZE, (batch_size, K))
        draft[position] = [3, 4, 5]
        num_draft = rng.integers(0, K + 1, batch_size)
        num_draft[position] = K
        context = np.concatenate([np.full((batch_size, 1), START), draft], axis=1)
        all_params = [SamplingParams(temperature=0.8)] * batch_size
        all_params[position] = params
        generators = [None] * batch_size
        generators[position] = make_request_generator(params.seed)
        uniforms = draw_spec_uniforms(np.random.Generator(np.random.PCG64(batch_size)),
                                      all_params, generators, num_draft)
        out = rejection_sample(p_table[context], draft, num_draft, q_table[context[:, :K]],
                               np.zeros(batch_size, bool), uniforms)
        return out.emitted(position).tolist()

    results = {tuple(run(n, pos)) for n, pos in [(1, 0), (5, 2), (9, 8), (30, 11)]}
    assert len(results) == 1


def test_verification_positions_see_the_draft_history():
    vocab_size = 12
    rng = np.random.default_rng(0)
    p = SamplingParams(min_tokens=2, temperature=0.9, repetition_penalty=2.0)
    p._bad_words_token_ids = [[3, 5]]
    drafts = [[3, 1], [7]]
    logits = rng.normal(0.0, 1.0, (3 + 2, vocab_size)).astype(np.float32)
    logits[:, 3] = 4.0  # positive: the repetition penalty divides it once 3 is in the output
    prompts, outputs = [np.array([2]), np.array([2])], [[], [6]]
    padded = verification_weights(logits, [p, p], prompts, outputs, drafts, [EOS])
    assert padded.shape == (2, 3, vocab_size)
    w = padded[0]
    assert w[0, EOS] == 0 and w[1, EOS] == 0 and w[2, EOS] > 0  # min_tokens: 0, 1, then 2
    assert w[1, 5] == 0 and w[0, 5] > 0 and w[2, 5] > 0  # bad word "3 5" after draft token 3
    ratio = lambda row: row[3] / row[4]  # noqa: E731
    expected = math.exp((4.0 / 2.0 - 4.0 - logits[1, 4] + logits[0, 4]) / 0.9)
    assert ratio(w[1]) / ratio(w[0]) == pytest.approx(expected, rel=1e-4)  # penalty from pos 1
    # Request 1: one draft token, two positions (history [6], then [6, 7]); then padding.
    np.testing.assert_array_equal(padded[1, 2], 0)
    single = processed_weights(logits[4:5], [p], prompts[1:], [[6, 7]], [EOS])
    np.testing.assert_array_equal(padded[1, 1], single[0])
    draft_side = verification_weights(logits[[0, 1, 3]], [p, p], prompts, outputs, drafts,
                                      [EOS], with_bonus=False)
    assert draft_side.shape == (2, 2, vocab_size)
    np.testing.assert_array_equal(draft_side[0], padded[0, :2])


def test_arguments_are_checked():
    p = np.full((1, 2, 3), 1 / 3, dtype=np.float32)
    u = np.zeros((1, 2))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(p, np.array([[0]]), np.array([2]), None, np.array([False]), u)
    with pytest.raises(ValueError, match="vocabulary"):
        rejection_sample(p, np.array([[3]]), np.array([1]), None, np.array([False]), u)
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(p, np.array([[0]]), np.array([1]), None, np.array([False]), u[:, :1])
    with pytest.raises(ValueError, match="positions"):
        verification_weights(np.zeros((2, 3)), [SamplingParams()], [np.array([1])], [[]],
                             [[1, 2]], [EOS])
