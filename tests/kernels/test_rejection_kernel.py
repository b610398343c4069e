"""cuda/rejection_sample.cu (through runtime/kernels/rejection.py) against the numpy reference
runtime/spec_decode/rejection_sampler.rejection_sample: the same emitted tokens and counts on
random batches (greedy and sampled rows, n-gram point-mass drafts and draft-model weights,
per-request draft lengths 0 .. K, vocabularies of 1, 17, 300 and 1000 ids) and on cases built
to accept everything, reject at once, and draw from a residual with no mass."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import kernel_module, to_device
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.kernels.rejection import rejection_sample as kernel_rejection_sample
from pagedrun.runtime.spec_decode.rejection_sampler import rejection_sample


def sparse_weights(rng, shape, keep=0.3):
    """Filtered-looking weights: many exact zeros, every row with mass; float32."""
    w = rng.random(shape).astype(np.float32) ** 3
    w *= rng.random(shape) < keep
    flat = w.reshape(-1, shape[-1])
    empty = ~flat.any(axis=1)
    flat[empty, rng.integers(0, shape[-1], empty.sum())] = 1.0
    return w


def one_hot_rows(weights, greedy):
    """Greedy rows of verification weights are 1.0 at the argmax, 0 elsewhere."""
    out = weights.copy()
    for b in np.flatnonzero(greedy):
        arg = out[b].argmax(axis=-1)
        out[b] = 0.0
        out[b, np.arange(out.shape[1]), arg] = 1.0
    return out


def check(target, draft_ids, num_draft, draft_w, greedy, uniforms):
    expected = rejection_sample(target, draft_ids, num_draft, draft_w, greedy, uniforms)
    got = kernel_rejection_sample(
        kernel_module("rejection_sample.cu"), to_device(target), to_device(draft_ids),
        to_device(num_draft), None if draft_w is None else to_device(draft_w),
        to_device(greedy.astype(np.int32)), to_device(uniforms))
    np.testing.assert_array_equal(got.num_emitted, expected.num_emitted)
    np.testing.assert_array_equal(got.token_ids, expected.token_ids)
    return got


@pytest.mark.parametrize("vocab", (1, 17, 300, 1000))
@pytest.mark.parametrize("with_draft_probs", (False, True))
def test_matches_reference(rng, vocab, with_draft_probs):
    num_reqs, k_max = 13, 4
    greedy = rng.random(num_reqs) < 0.3
    target = one_hot_rows(sparse_weights(rng, (num_reqs, k_max + 1, vocab)), greedy)
    num_draft = rng.integers(0, k_max + 1, num_reqs).astype(np.int32)
    num_draft[0] = 0  # a request with no proposal: the plain sampler's draw
    # Half the proposals are the target's likeliest token (long accepted runs), half random.
    likely = target[:, :k_max].argmax(axis=-1)
    draft_ids = np.where(rng.random((num_reqs, k_max)) < 0.5, likely,
                         rng.integers(0, vocab, (num_reqs, k_max))).astype(np.int32)
    draft_w = sparse_weights(rng, (num_reqs, k_max, vocab)) if with_draft_probs else None
    if draft_w is not None:  # a draft model drew its proposals from q: they have mass
        draft_w[np.arange(num_reqs)[:, None], np.arange(k_max)[None, :], draft_ids] += 0.5
    uniforms = rng.random((num_reqs, k_max + 1))
    got = check(target, draft_ids, num_draft, draft_w, greedy, uniforms)
    assert (got.num_emitted >= 1).all() and (got.num_emitted <= num_draft + 1).all()


def test_all_accepted_then_bonus(rng):
    # q == p: u q(x) < p(x) for every u < 1, so every proposal is accepted and the bonus drawn.
    num_reqs, k_max, vocab = 5, 3, 50
    target = sparse_weights(rng, (num_reqs, k_max + 1, vocab))
    draft_w = target[:, :k_max].copy()
    draft_ids = np.array([[rng.choice(np.flatnonzero(draft_w[b, i])) for i in range(k_max)]
                          for b in range(num_reqs)], dtype=np.int32)
    got = check(target, draft_ids, np.full(num_reqs, k_max, np.int32), draft_w,
                np.zeros(num_reqs, bool), rng.random((num_reqs, k_max + 1)))
    assert (got.num_emitted == k_max + 1).all()


def test_rejections_draw_from_the_residual(rng):
    # Proposals the target gives no mass: rejected at position 0, drawn from p minus the point
    # mass (n-gram) or max(0, p - q) (draft model), never the proposal itself.
    num_reqs, k_max, vocab = 8, 2, 40
    target = sparse_weights(rng, (num_reqs, k_max + 1, vocab))
    draft_ids = target[:, :k_max].argmin(axis=-1).astype(np.int32)
    target[np.arange(num_reqs)[:, None], np.arange(k_max)[None, :], draft_ids] = 0.0
    for draft_w in (None, sparse_weights(rng, (num_reqs, k_max, vocab))):
        got = check(target, draft_ids, np.full(num_reqs, k_max, np.int32), draft_w,
                    np.zeros(num_reqs, bool), rng.random((num_reqs, k_max + 1)))
        assert (got.num_emitted == 1).all()
        assert (got.token_ids[:, 0] != draft_ids[:, 0]).all()


def test_residual_without_mass_falls_back_to_p(rng):
    # q >= p everywhere that p has mass (q = p + extra mass on one token p lacks): a rejection
    # (of that token) finds max(0, p - q) empty and draws from p.
    num_reqs, vocab = 6, 30
    target = sparse_weights(rng, (num_reqs, 2, vocab))
    draft_ids = target[:, :1].argmin(axis=-1).astype(np.int32)
    target[np.arange(num_reqs), 0, draft_ids[:, 0]] = 0.0
    p = target[:, 0] / target[:, 0].sum(axis=-1, keepdims=True)
    q = p.copy()
    q[np.arange(num_reqs), draft_ids[:, 0]] = 1.0  # q / sum(q) = p / 2 + point mass / 2
    got = check(target, draft_ids, np.ones(num_reqs, np.int32), q[:, None].astype(np.float32),
                np.zeros(num_reqs, bool), rng.random((num_reqs, 2)))
    assert (target[np.arange(num_reqs), 0, got.token_ids[:, 0]] > 0).all()


def test_rejects_bad_arguments(rng):
    module = kernel_module("rejection_sample.cu")
    target = sparse_weights(rng, (2, 3, 10))
    ids = np.zeros((2, 2), np.int32)
    u = rng.random((2, 3))
    with pytest.raises(UnsupportedKernelShape, match="float32"):
        kernel_rejection_sample(module, to_device(target.astype(np.float64)), ids,
                                np.array([2, 2]), None, np.zeros(2), u)
    with pytest.raises(UnsupportedKernelShape, match="num_draft_tokens"):
        kernel_rejection_sample(module, to_device(target), ids, np.array([3, 0]), None,
                                np.zeros(2), u)
    with pytest.raises(UnsupportedKernelShape, match="vocabulary"):
        kernel_rejection_sample(module, to_device(target), np.full((2, 2), 10, np.int32),
                                np.array([2, 2]), None, np.zeros(2), u)
    with pytest.raises(UnsupportedKernelShape, match="uniforms"):
        kernel_rejection_sample(module, to_device(target), ids, np.array([2, 2]), None,
                                np.zeros(2), u[:, :2])
