"""Forks share the parent's logits row (issue 36, runtime/logits_row_groups.py).

- group_rows: the n siblings (one logits row, one params object, one prompt object, equal
  outputs) are one group; look-alike rows (equal but separate params) stay apart; the identity
  is detected; a bad row_index is refused.
- The numpy Sampler on a batch whose first tokens fork n ways gives exactly the tokens and
  logprobs it gives when every sibling has its own copy of the row (the reference: the rows
  expanded by hand, which group_rows never shares), in every logprobs mode, penalized and
  filtered rows mixed, vocabularies that are not a multiple of the CDF chunk.
- Memory: n = 256 siblings of one row allocate nothing of size n x vocabulary (tracemalloc sees
  numpy's buffers): the old path copied the row per sibling.
(The kernel sampler's twin of the equality check: tests/kernels/test_sampling_kernel.py.)
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from pagedrun.runtime.engine_config import LOGPROBS_MODES
from pagedrun.runtime.logits_row_groups import group_rows
from pagedrun.runtime.sampler import CDF_CHUNK, Sampler, make_request_generator
from pagedrun.runtime.sampling_params import SamplingParams


@pytest.fixture
def rng() -> np.random.Generator:
    seq = np.random.SeedSequence()  # fresh inputs every run; the entropy replays one
    print(f"numpy SeedSequence entropy={seq.entropy}")
    return np.random.default_rng(seq)


def test_siblings_form_one_group_and_look_alikes_do_not():
    p, q = SamplingParams(temperature=0.7), SamplingParams(temperature=0.7)
    prompt = np.arange(5)
    outputs = [[], [], [], [], [3], [3]]
    # rows 0-2: siblings of logits row 4; row 3: same row, equal but separate params; rows 4-5:
    # two sequences reading rows 0 and 2.
    groups = group_rows([4, 4, 4, 4, 0, 2], 5, [p, p, p, q, p, p], [prompt] * 6, outputs)
    assert groups.logits_rows.tolist() == [4, 4, 0, 2]
    assert groups.group_of.tolist() == [0, 0, 0, 1, 2, 3]
    assert groups.first == [0, 3, 4, 5]
    assert groups.members() == [[0, 1, 2], [3], [4], [5]]
    assert not groups.identity
    # Same row and params but different outputs: apart.
    split = group_rows([1, 1], 2, [p, p], [prompt, prompt], [[1], [2]])
    assert split.group_of.tolist() == [0, 1]
    assert group_rows(None, 3, [p, p, p], [prompt] * 3, [[]] * 3).identity
    assert group_rows([0, 1, 2], 3, [p, p, p], [prompt] * 3, [[]] * 3).identity
    assert not group_rows([1, 0], 2, [p, p], [prompt] * 2, [[]] * 2).identity


def test_bad_row_index_is_refused():
    p = SamplingParams()
    with pytest.raises(IndexError, match="outside"):
        group_rows([0, 3], 3, [p, p], [np.arange(2)] * 2, [[]] * 2)
    with pytest.raises(ValueError, match="entries"):
        group_rows([0], 3, [p, p], [np.arange(2)] * 2, [[]] * 2)
    with pytest.raises(ValueError, match="no row_index"):
        group_rows(None, 3, [p, p], [np.arange(2)] * 2, [[]] * 2)


def forked_batch(rng, vocab: int):
    """A step where three requests fork (n = 4, 3, 2) and two sequences continue: logits
    [5, vocab], and per sampling row (params, generator seed, prompt, output, logits row)."""
    kinds = [
        SamplingParams(n=4, seed=11, temperature=0.9, top_k=7, top_p=0.8, min_p=0.01,
                       repetition_penalty=1.3, logit_bias={1: 2.0}, logprobs=3),
        # top_k = 1: every sibling must draw the one kept token (greedy refuses n > 1)
        SamplingParams(n=3, temperature=0.5, top_k=1, presence_penalty=0.5, logprobs=2),
        SamplingParams(n=2, temperature=1.2, logprobs=-1),
    ]
    rows = []
    for logits_row, p in enumerate(kinds):
        prompt = rng.integers(0, vocab, 6)
        output: list[int] = []
        rows += [(p, None if p.seed is None else p.seed + j, prompt, output, logits_row)
                 for j in range(p.n)]
    for logits_row in (3, 4):  # two sequences past their first token
        rows.append((SamplingParams(temperature=0.6, top_p=0.9, logprobs=1), 100 + logits_row,
                     rng.integers(0, vocab, 4), list(rng.integers(0, vocab, 3)), logits_row))
    logits = (3 * rng.standard_normal((5, vocab))).astype(np.float32)
    logits[2, vocab // 2:] = -np.inf  # half of one forked row masked
    return logits, rows


def sample(sampler, logits, rows, shared: bool):
    """Sampler.sample over `rows`; shared: the engine's form (row_index into `logits`), else
    every row its own copy of its logits row (row_index None)."""
    params = [r[0] for r in rows]
    generators = [make_request_generator(r[1]) for r in rows]
    prompts = [r[2] for r in rows]
    if shared:
        return sampler.sample(logits.copy(), params, generators, prompts,
                              [r[3] for r in rows], row_index=[r[4] for r in rows])
    expanded = logits[[r[4] for r in rows]]
    return sampler.sample(expanded, params, generators, [p.copy() for p in prompts],
                          [list(r[3]) for r in rows])


@pytest.mark.parametrize("vocab", (17, CDF_CHUNK + 1, 3000))
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_shared_rows_sample_what_copies_sample(rng, vocab, mode):
    logits, rows = forked_batch(rng, vocab)
    got = sample(Sampler([0], seed=5, logprobs_mode=mode), logits, rows, shared=True)
    ref = sample(Sampler([0], seed=5, logprobs_mode=mode), logits, rows, shared=False)
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    assert got.logprobs == ref.logprobs
    assert len(set(got.token_ids[4:7].tolist())) == 1  # top_k = 1 siblings: one token


def test_many_siblings_allocate_nothing_per_sibling_row(rng):
    """256 siblings of one 49,152-token row: the old path copied the row per sibling
    (256 x 49,152 x 4 B = 48 MiB, and its processing copies: a 132 MiB peak). Now what is
    per sibling is the inverse CDF's chunk of CDF_CHUNK tokens: the float32 weights, two
    float64 cumulative sums and bool masks, 24 B a token at most; the rest is a few [1, vocab]
    float32 rows (the processed copy, filter_rows' final and weights and their temporaries),
    16 of them allowed."""
    n, vocab = 256, 49152
    p = SamplingParams(n=n, temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    prompt = rng.integers(0, vocab, 8)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    sampler = Sampler([0], seed=1)
    generators = [make_request_generator(7 + j) for j in range(n)]
    tracemalloc.start()
    try:
        out = sampler.sample(logits, [p] * n, generators, [prompt] * n, [[] for _ in range(n)],
                             row_index=[0] * n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = n * CDF_CHUNK * 24 + 16 * vocab * 4
    assert peak < bound, f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
    assert n * vocab * 4 > 4 * bound  # the old copies could not have passed
    assert out.token_ids.shape == (n,) and len(set(out.token_ids.tolist())) > 1
