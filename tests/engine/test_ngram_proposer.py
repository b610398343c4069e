"""runtime/spec_decode/ngram_proposer.py against a naive reference (issue 17), and
SpeculativeConfig's validation (runtime/spec_decode/spec_config.py, vLLM's field names).

The reference scans the obvious way: n from prompt_lookup_max down to prompt_lookup_min, start
j from L - n - 1 down to 0, the first j with t[j:j+n] == t[L-n:] wins, propose t[j+n:j+n+k]
(capped). Sequences: random over small alphabets (many matches), adversarial ones (one token
repeated, periodic text whose matches overlap the suffix, a match that ends right before the
last token, n longer than the sequence, empty and one-token sequences), in batches that mix
them so the flat, concatenated layout is exercised across request boundaries.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedrun.runtime.spec_decode.ngram_proposer import NgramProposer
from pagedrun.runtime.spec_decode.spec_config import (DEFAULT_PROMPT_LOOKUP, SpeculativeConfig,
                                                      SpeculativeConfigError)


def naive_propose(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    t = [int(x) for x in tokens]
    length = len(t)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = t[length - n:]
        for j in range(length - n - 1, -1, -1):
            if t[j:j + n] == suffix:
                return t[j + n:j + n + k]
    return []


def check_batch(seqs, min_n, max_n, k, caps=None):
    proposer = NgramProposer(min_n, max_n, k)
    got = proposer.propose([np.asarray(s, dtype=np.int64) for s in seqs], caps)
    assert len(got) == len(seqs)
    for b, s in enumerate(seqs):
        cap = k if caps is None else max(0, min(k, caps[b]))
        want = naive_propose(s, min_n, max_n, k)[:cap]
        assert got[b].dtype == np.int32
        assert got[b].tolist() == want, (b, list(s), min_n, max_n, k, cap)


def test_worked_examples():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3, num_speculative_tokens=3)
    # "1 2 3" appears twice earlier; the latest occurrence (at 4) wins: 9 follows it.
    assert p.propose([np.array([1, 2, 3, 7, 1, 2, 3, 9, 5, 1, 2, 3])])[0].tolist() == [9, 5, 1]
    # Longest n first: "5 1 2" (n = 3) beats the later "1 2" (n = 2).
    got = p.propose([np.array([5, 1, 2, 8, 8, 1, 2, 6, 5, 1, 2])])[0].tolist()
    assert got == [8, 8, 1]
    # Match right before the end: one token follows it.
    assert p.propose([np.array([4, 4, 4])])[0].tolist() == [4]
    # Overlapping: "3 3 3" (n = 3) latest earlier start is 1, overlapping the suffix; only
    # one token follows it.
    assert p.propose([np.array([3, 3, 3, 3, 3])])[0].tolist() == [3]
    # No match, too short, empty.
    assert [a.tolist() for a in p.propose([np.array([1, 2, 3, 4]), np.array([1]),
                                           np.array([], dtype=np.int64)])] == [[], [], []]


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 3, 4), (2, 4, 4), (3, 5, 2),
                                            (5, 5, 8), (1, 8, 3)])
def test_random_batches_match_reference(min_n, max_n, k):
    rng = np.random.default_rng(1000 * min_n + 10 * max_n + k)
    for _ in range(25):
        seqs = []
        for _ in range(int(rng.integers(1, 12))):
            length = int(rng.integers(0, 60))
            alphabet = int(rng.integers(1, 5))  # small alphabets: many, overlapping matches
            seqs.append(rng.integers(0, alphabet, size=length))
        caps = rng.integers(-1, k + 2, size=len(seqs)).tolist() if rng.random() < 0.5 else None
        check_batch(seqs, min_n, max_n, k, caps)


def test_adversarial_sequences_match_reference():
    seqs = [
        [7] * 40,                                   # one token repeated
        [1, 2] * 15,                                # period 2: every match overlaps
        [1, 2, 3] * 10 + [1, 2],                    # period 3, ends mid-period
        [9, 8, 7, 6, 9, 8, 7],                      # match ending right before the suffix
        [5, 6, 5, 6],                               # match overlapping the suffix by one
        [1, 2, 3, 4, 5, 6, 7, 8],                   # no repeat at all
        [4],                                        # shorter than any n-gram
        [],                                         # empty
        [2, 2],                                     # n larger than the sequence for n >= 2
        list(range(30)) + list(range(5)),           # a long-ago single match
        [0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1], # near-matches of growing length
    ]
    for min_n, max_n, k in [(1, 1, 3), (1, 4, 5), (2, 3, 2), (3, 6, 4), (6, 10, 3)]:
        check_batch(seqs, min_n, max_n, k)
        check_batch(seqs[::-1], min_n, max_n, k, caps=[1, 0, 2, -3, 5, 1, 1, 2, 9, 3, 1])


def test_long_sequence_and_large_batch_match_reference():
    rng = np.random.default_rng(7)
    base = rng.integers(0, 50, size=300)
    copy = np.concatenate([base, rng.integers(0, 50, size=40), base[:120]])  # copy-heavy
    seqs = [copy, rng.integers(0, 3, size=2000)] + [rng.integers(0, 4, size=int(n))
                                                     for n in rng.integers(1, 80, size=200)]
    check_batch(seqs, 2, 4, 4)


def test_proposer_arguments_are_checked():
    with pytest.raises(ValueError):
        NgramProposer(3, 2, 4)
    with pytest.raises(ValueError):
        NgramProposer(0, 2, 4)
    with pytest.raises(ValueError):
        NgramProposer(1, 2, 0)
    with pytest.raises(ValueError, match="caps"):
        NgramProposer(1, 2, 2).propose([np.array([1, 1])], [1, 2])


# ----------------------------------------------------------------------- SpeculativeConfig

def test_config_vllm_shapes():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
            cfg.prompt_lookup_max) == ("ngram", 4, 2, 4)
    p = NgramProposer.from_config(cfg)
    assert (p.min_n, p.max_n, p.k) == (2, 4, 4)
    draft = SpeculativeConfig.from_json(json.dumps({"method": "draft_model", "model": "/m",
                                                    "num_speculative_tokens": 3}))
    assert (draft.method, draft.model) == ("draft_model", "/m")
    # vLLM: a model without a method is a draft model.
    assert SpeculativeConfig(model="/m", num_speculative_tokens=2).method == "draft_model"
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer.from_config(draft)


def test_config_lookup_defaults_follow_vllm():
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert both.prompt_lookup_min == both.prompt_lookup_max == DEFAULT_PROMPT_LOOKUP
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert only_max.prompt_lookup_min == 3
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert only_min.prompt_lookup_max == 2


@pytest.mark.parametrize("values,field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 1}, "speculative_config"),
])
def test_config_errors_name_the_field(values, field):
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_dict(values)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_config_json_errors():
    with pytest.raises(SpeculativeConfigError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")
    with pytest.raises(SpeculativeConfigError, match="JSON object"):
        SpeculativeConfig.from_json("[1, 2]")


def test_config_disable_by_batch_size():
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_dict(base).disable_by_batch_size is None  # never off
    assert SpeculativeConfig.from_dict({**base, "disable_by_batch_size": 8}) \
        .disable_by_batch_size == 8
    assert SpeculativeConfig.from_dict({**base, "disable_by_batch_size": 1}) \
        .disable_by_batch_size == 1
    for bad in (0, -1, True, "3", 2.0):
        with pytest.raises(SpeculativeConfigError) as info:
            SpeculativeConfig.from_dict({**base, "disable_by_batch_size": bad})
        assert str(info.value).startswith("disable_by_batch_size:"), str(info.value)
