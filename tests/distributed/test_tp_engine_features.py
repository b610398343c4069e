"""Every block move and logits path of a step reaches the workers: at TP=2, a run that swaps
sequences out and back in (a KV pool too small for the batch), forks n = 2 samples onto shared
prompt blocks (copy-on-write), asks for prompt logprobs (extra gathered logits rows) and seeded
random sampling produces exactly TP=1's tokens, and logprobs equal to float32 rounding."""
from __future__ import annotations

import numpy as np

from tp_helpers import make_engine, prompts, write_model_dir

from pagedrun.runtime.sampling_params import SamplingParams

VOCAB = 389
LOGPROB_ATOL = 1e-4


def run(engine, prompt_ids):
    results = {}
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(temperature=0.8, top_k=50, seed=100 + i, n=2, max_tokens=12,
                                ignore_eos=True, logprobs=2,
                                prompt_logprobs=2 if i % 2 else None)
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            entry = results.setdefault(out.request_id, {"prompt": None, "seqs": {}})
            if out.prompt_logprobs is not None:
                entry["prompt"] = out.prompt_logprobs
            for comp in out.outputs:
                seq = entry["seqs"].setdefault(comp.index, ([], []))
                seq[0].extend(comp.token_ids)
                seq[1].extend(comp.logprobs or [])
    return results, engine.get_stats()["num_preemptions_total"]


def test_swap_fork_prompt_logprobs_match_tp1(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, num_key_value_heads=2)
    kw = dict(num_kv_blocks=14, preemption_mode="swap", swap_space_bytes=1 << 22)
    ps = prompts(VOCAB)
    ref, ref_preemptions = run(make_engine(model_dir, 1, **kw), ps)
    engine = make_engine(model_dir, 2, **kw)
    try:
        got, preemptions = run(engine, ps)
    finally:
        engine.close()
    assert ref_preemptions > 0 and preemptions == ref_preemptions  # swaps really happened
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid]["seqs"].keys() == ref[rid]["seqs"].keys() == {0, 1}
        for index, (ref_tokens, ref_lps) in ref[rid]["seqs"].items():
            tokens, lps = got[rid]["seqs"][index]
            assert tokens == ref_tokens
            assert [list(p) for p in lps] == [list(p) for p in ref_lps]  # same ids, order
            np.testing.assert_allclose(_flat(lps), _flat(ref_lps), atol=LOGPROB_ATOL)
        if ref[rid]["prompt"] is not None:
            want, have = ref[rid]["prompt"][1:], got[rid]["prompt"][1:]
            assert len(have) == len(want) > 0
            assert [list(p) for p in have] == [list(p) for p in want]
            np.testing.assert_allclose(_flat(have), _flat(want), atol=LOGPROB_ATOL)


def _flat(positions) -> list[float]:
    """Every logprob of a list of {token_id: Logprob} positions, in order."""
    return [lp.logprob for position in positions for lp in position.values()]


def test_speculative_decoding_matches_tp1(tmp_path):
    """n-gram speculation at TP=2: the rows' draft counts reach the workers (every rank
    gathers the logits of every verified position), and greedy and seeded sampled requests
    produce exactly TP=1's tokens with the same acceptance."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, num_key_value_heads=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}
    rng = np.random.default_rng(4)
    phrase = rng.integers(3, VOCAB, 4).tolist()
    prompt_ids = [phrase * 5, (phrase[::-1] * 4)[:13]]
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.7, seed=9, max_tokens=16)]
    results = []
    for tp in (1, 2):
        engine = make_engine(model_dir, tp, speculative_config=spec)
        try:
            for i, ids in enumerate(prompt_ids):
                engine.add_request(f"s{i}", prompt_token_ids=ids, sampling_params=params[i])
            tokens = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            stats = engine.get_stats()
        finally:
            engine.close()
        results.append((tokens, stats["spec_decode_num_draft_tokens"],
                        stats["spec_decode_num_accepted_tokens"]))
    assert results[1] == results[0]
    assert results[0][1] > 0
