"""The engine's per-token stop test (Request.token_stops, stop_checker.token_stop_bounds): a
token of a request without stop strings that neither reaches the length limit nor is a stop
token id is only appended; every other token takes the full check. It must never miss a stop:
  - token_stop_bounds against check_token_stop on random cases;
  - random requests (max_tokens, max_model_len, min_tokens, EOS with and without ignore_eos,
    stop_token_ids, n > 1, logprobs, a stop string for some) run once as the engine runs them
    and once with every token through _append_token: the same deltas, and every sequence
    ends exactly where replaying check_token_stop over its tokens says, for the reason it
    says."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import TINY_VOCAB, PieceTokenizer, make_engine, random_prompts
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.stop_checker import check_token_stop, token_stop_bounds

EOS = 2  # the tiny model's
MAX_MODEL_LEN = 48
BIAS = 4.0  # added to the logits of EOS and the stop token ids: they are sampled often


def _random_params(rng: np.random.Generator, with_strings: bool = False) -> SamplingParams:
    stop_ids = rng.choice(np.arange(3, TINY_VOCAB), size=int(rng.integers(0, 4)),
                          replace=False).tolist()
    max_tokens = None if rng.random() < 0.25 else int(rng.integers(1, 14))
    return SamplingParams(
        n=int(rng.choice([1, 1, 2])), temperature=1.0, seed=int(rng.integers(1 << 30)),
        max_tokens=max_tokens, min_tokens=min(int(rng.choice([0, 0, 2, 5])), max_tokens or 5),
        ignore_eos=bool(rng.random() < 0.3),
        stop_token_ids=stop_ids or None,
        logprobs=1 if rng.random() < 0.3 else None,
        logit_bias={t: BIAS for t in [EOS, *stop_ids]},
        stop=["zz"] if with_strings else None)


def test_bounds_never_miss_a_stop_on_random_cases():
    rng = np.random.default_rng(0)
    hits = {"length": 0, "stop": 0, None: 0}
    for _ in range(20000):
        max_model_len = int(rng.integers(2, 40))
        prompt_len = int(rng.integers(1, max_model_len))
        stop_ids = rng.integers(0, 12, int(rng.integers(0, 3))).tolist()
        max_tokens = None if rng.random() < 0.3 else int(rng.integers(1, 20))
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=int(rng.integers(0, min(6, max_tokens or 6))),
            ignore_eos=bool(rng.random() < 0.4),
            stop_token_ids=stop_ids or None)
        eos = frozenset(rng.integers(0, 12, int(rng.integers(0, 3))).tolist())
        length_limit, may_stop = token_stop_bounds(params, prompt_len, eos, max_model_len)
        token = int(rng.integers(0, 12))
        num_output = int(rng.integers(1, max_model_len - prompt_len + 2))
        stop = check_token_stop(params, token, num_output, prompt_len + num_output, eos,
                                max_model_len)
        hits[None if stop is None else stop[0]] += 1
        if num_output < length_limit and token not in may_stop:
            assert stop is None, (params, prompt_len, eos, max_model_len, token, num_output)
        if stop is not None and stop[0] == "length":
            assert num_output >= length_limit  # the limit is exact, not just an upper bound
    assert min(hits.values()) > 500  # every answer was exercised


def _run(engine, requests) -> dict[str, list[tuple]]:
    """request id -> its deltas, each (index, token_ids, text, finish_reason, stop_reason,
    logprobs, cumulative_logprob) per completion, plus the final output's finished flag."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=params)
    deltas: dict[str, list[tuple]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append((out.finished, [
                (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
                 c.cumulative_logprob) for c in out.outputs]))
    return deltas


def _completions(deltas: list[tuple]) -> dict[int, tuple[list[int], str, object]]:
    """index -> (all token ids, finish_reason, stop_reason) from a request's deltas."""
    tokens: dict[int, list[int]] = {}
    ends: dict[int, tuple] = {}
    for _, completions in deltas:
        for index, token_ids, _, finish, stop, _, _ in completions:
            tokens.setdefault(index, []).extend(token_ids)
            if finish is not None:
                ends[index] = (finish, stop)
    return {i: (tokens[i], *ends[i]) for i in tokens}


@pytest.mark.parametrize("seed", [1, 2])
def test_engine_stops_exactly_as_the_full_check_on_random_requests(tiny_cpu_model, seed):
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, TINY_VOCAB, 40, MAX_MODEL_LEN - 2)
    requests = [(f"r{i}", p, _random_params(rng, with_strings=i % 8 == 7))
                for i, p in enumerate(prompts)]

    def engine(full_path: bool):
        e = make_engine(tiny_cpu_model, PieceTokenizer(), num_kv_blocks=256,
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                        max_num_batched_tokens=128)
        if full_path:
            e._token_stops = lambda request: False
        return e

    batched, full = engine(False), engine(True)
    got, want = _run(batched, requests), _run(full, requests)
    assert got == want
    assert (batched.get_stats()["generation_tokens_total"]
            == full.get_stats()["generation_tokens_total"])

    eos = batched.eos_token_ids
    seen = set()
    for request_id, prompt, params in requests:
        for index, (tokens, finish, stop) in _completions(got[request_id]).items():
            replay = [check_token_stop(params, t, k + 1, len(prompt) + k + 1, eos, MAX_MODEL_LEN)
                      for k, t in enumerate(tokens)]
            assert all(r is None for r in replay[:-1]), (request_id, index, tokens, replay)
            if stop == "zz":  # a stop string (it wins over the token's own answer)
                seen.add("stop string")
                continue
            assert replay[-1] == (finish, stop), (request_id, index, tokens, replay)
            seen.add("stop token id" if stop is not None else "eos" if finish == "stop"
                     else "max_tokens" if len(tokens) == params.max_tokens else "max_model_len")
    assert seen >= {"max_tokens", "max_model_len", "eos", "stop token id"}, seen
