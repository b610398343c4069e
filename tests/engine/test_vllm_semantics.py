"""vLLM conformance: one test per point of issue 22 (docs/engine_api.md, "vLLM conformance" has
the table). Each test's docstring names the vLLM source file and function whose rule it checks and
restates the rule; every expected value is derived here, from the dense reference model
(runtime/reference.py) or from the tokenizer, never from the engine under test.

Most points run on the tiny in-memory models of engine_helpers.py (every engine backend); the
few that need a real tokenizer or chat template -- bad words, the chat options, and the
first-token distribution check of two sampling combinations -- run on the default model
(SmolLM2-135M-Instruct, cpu), loaded once for the module.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from engine_helpers import (TINY_VOCAB, PieceTokenizer, backend_of, greedy, make_engine,
                            reference_greedy, run_requests)
from pagedrun.runtime.chat_options import ChatOptions, ChatOptionsError
from pagedrun.runtime.engine import RequestError
from pagedrun.runtime.llm import LLM, _merge
from pagedrun.runtime.reference import ReferenceModel
from pagedrun.runtime.sampling_params import (RequestOutputKind, SamplingParams,
                                              SamplingParamsError)

PROMPT = [17, 250, 33, 91, 120, 7, 300, 44, 5, 66, 201, 12]


# ---------------------------------------------------------------------------- references

def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    out = np.zeros_like(x, dtype=np.float64)
    e = np.exp(x[finite] - x[finite].max())
    out[finite] = e / e.sum()
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    out = np.full_like(x, -np.inf)
    shifted = x[finite] - x[finite].max()
    out[finite] = shifted - np.log(np.exp(shifted).sum())
    return out


def reference_probs(logits: np.ndarray, *, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, logit_bias: dict | None = None,
                    repetition_penalty: float = 1.0, seen_token_ids=(),
                    order: str = "min_p,top_k,top_p") -> np.ndarray:
    """The next-token distribution by vLLM's rules (vllm/v1/sample/sampler.py Sampler.forward,
    ops/topk_topp_sampler.py apply_top_k_top_p), in float64: logit bias, repetition penalty
    (over the prompt and output ids `seen_token_ids`: positive logits divided, others
    multiplied), temperature, then the filters in `order` (vLLM's: min_p, top_k, top_p; tests
    pass another order to show the check would catch a swap)."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for token_id, bias in (logit_bias or {}).items():
        x[token_id] += bias
    seen = np.unique(np.asarray(list(seen_token_ids), dtype=np.int64))
    if repetition_penalty != 1.0 and seen.size:
        x[seen] = np.where(x[seen] > 0, x[seen] / repetition_penalty,
                           x[seen] * repetition_penalty)
    x /= temperature

    def apply_min_p(x):
        p = _softmax(x)
        return np.where(p < min_p * p.max(), -np.inf, x)

    def apply_top_k(x):
        if top_k <= 0:
            return x
        kth = np.sort(x)[-top_k]
        return np.where(x < kth, -np.inf, x)

    def apply_top_p(x):
        if top_p >= 1.0:
            return x
        p = _softmax(x)
        ascending = np.argsort(p, kind="stable")
        drop = np.cumsum(p[ascending]) <= 1.0 - top_p
        drop[-1] = False  # the most likely token always stays
        x = x.copy()
        x[ascending[drop]] = -np.inf
        return x

    steps = {"min_p": apply_min_p, "top_k": apply_top_k, "top_p": apply_top_p}
    for name in order.split(","):
        x = steps[name](x)
    return _softmax(x)


def distribution_bound(probs: np.ndarray, num_draws: int) -> np.ndarray:
    """Per token, how far a frequency over `num_draws` draws may stray from its probability:
    5 binomial standard deviations + 1/N for the discreteness. Over the <= ~100 tokens of the
    supports here a false alarm has a chance below 1e-4."""
    return 5.0 * np.sqrt(probs * (1.0 - probs) / num_draws) + 1.0 / num_draws


def assert_matches_distribution(token_ids: list[int], probs: np.ndarray) -> None:
    """Draws against the distribution they should follow: no draw outside its support (a
    token given probability zero by a wrong rule fails at once), and each token's frequency
    within distribution_bound of its probability."""
    n = len(token_ids)
    counts = np.bincount(np.asarray(token_ids), minlength=probs.shape[0]) / n
    outside = np.flatnonzero((counts > 0) & (probs == 0))
    assert outside.size == 0, f"draws on tokens of probability 0: {outside.tolist()}"
    bound = distribution_bound(probs, n)
    worst = int(np.argmax(np.abs(counts - probs) - bound))
    assert np.all(np.abs(counts - probs) <= bound), (
        f"token {worst}: frequency {counts[worst]:.4f}, probability {probs[worst]:.4f}, "
        f"bound {bound[worst]:.4f} over {n} draws")


def assert_can_tell_apart(probs: np.ndarray, wrong: np.ndarray, num_draws: int) -> None:
    """The check above would fail for draws from `wrong` (the distribution of a planted bug):
    `wrong` puts real mass where `probs` has none, or moves a token's probability by twice
    the bound."""
    outside_mass = wrong[probs == 0].sum()
    moved = np.abs(wrong - probs) > 2 * distribution_bound(probs, num_draws)
    assert outside_mass * num_draws > 10 or moved.any()


def assert_support_is_stable(logits: np.ndarray, noise: float, **knobs) -> None:
    """The reference's support does not change when the logits move by `noise` (the engine's
    logits differ from the reference's by rounding, or by bf16 error): no token sits on a
    min_p / top_p / top_k boundary, where rounding alone would decide it."""
    support = reference_probs(logits, **knobs) > 0
    rng = np.random.default_rng(0)
    for _ in range(8):
        moved = logits + rng.uniform(-noise, noise, logits.shape)
        assert np.array_equal(reference_probs(moved, **knobs) > 0, support)


DRAWS_PER_REQUEST = 256  # n of one request: its children draw with seed .. seed + n - 1


def first_token_draws(engine, prompt: list[int], params: SamplingParams,
                      num_requests: int = 1) -> list[int]:
    """num_requests x params.n seeded first tokens (request i: seed + i x n, child j: + j; all
    distinct seeds), every one from the prompt's first logits row."""
    requests = [(0, f"draws{i}", dict(prompt_token_ids=prompt, sampling_params=dataclasses.replace(
        params, max_tokens=1, seed=params.seed + i * params.n))) for i in range(num_requests)]
    out = run_requests(engine, requests)
    return [c.token_ids[0] for i in range(num_requests) for c in out[f"draws{i}"].outputs]


def stream(engine, prompt, params, request_id="s"):
    """Run one request; (merged final output, every RequestOutput step() gave for it)."""
    engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=params)
    total, outputs = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.append(out)
            total = _merge(total, out)
    return total, outputs


def text_of(tokenizer, token_ids, skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def texts_after_each_token(tokenizer, tokens: list[int]) -> list[str]:
    """texts[k - 1]: the text of the first k tokens (special tokens skipped)."""
    return [text_of(tokenizer, tokens[:k]) for k in range(1, len(tokens) + 1)]


def code_and_message(engine, **kwargs) -> tuple[str, str]:
    kwargs.setdefault("prompt_token_ids", PROMPT)
    with pytest.raises(RequestError) as info:
        engine.add_request("refused", **kwargs)
    return info.value.code, info.value.message


# ---------------------------------------------------------------------------- sampling order

def test_min_p_applies_before_top_k_and_top_p(tiny_model):
    """vllm/v1/sample/sampler.py Sampler.sample: temperature, then min_p
    (MinPLogitsProcessor), then top_k and top_p (ops/topk_topp_sampler.py apply_top_k_top_p)
    -- so top_p's mass is counted over the tokens min_p kept. 256 seeded draws of one first
    token against that distribution; the old order (min_p last) puts ~25% of the mass on
    tokens vLLM gives probability zero here, which the support check catches."""
    # A prompt whose first-token support no rounding can move (assert_support_is_stable).
    prompt = np.random.default_rng(20).integers(3, TINY_VOCAB, 8).tolist()
    knobs = dict(temperature=2.0, top_k=50, top_p=0.7, min_p=0.2)
    params = SamplingParams(n=DRAWS_PER_REQUEST, seed=11, **knobs)
    logits = ReferenceModel(*tiny_model).forward(np.array(prompt))[-1]
    assert_support_is_stable(logits, 2 * backend_of(tiny_model).logprob_atol, **knobs)
    expected = reference_probs(logits, **knobs)
    assert_can_tell_apart(expected, reference_probs(logits, **knobs, order="top_k,top_p,min_p"),
                          DRAWS_PER_REQUEST)
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=128,
                         max_num_seqs=DRAWS_PER_REQUEST)
    assert_matches_distribution(first_token_draws(engine, prompt, params), expected)


# ---------------------------------------------------------------------------- stops

def _first_repeated_free(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_text_is_not_in_the_output(tiny_model):
    """vllm/v1/engine/detokenizer.py IncrementalDetokenizer.update: a sequence the engine
    stopped on a stop token (vllm/v1/core/sched/utils.py check_stop) does not detokenize that
    token unless include_stop_str_in_output -- its id stays in token_ids, its text never
    enters `text`, streamed or final; the same for EOS with skip_special_tokens=False."""
    prompt = np.random.default_rng(9).integers(3, TINY_VOCAB, 30).tolist()
    expected = reference_greedy(tiny_model, prompt, 16)
    k = _first_repeated_free(expected, 5)
    stop_id = expected[k]
    tokenizer = PieceTokenizer()
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    out, steps = stream(engine, prompt, greedy(16, stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == expected[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == text_of(tokenizer, expected[:k])
    assert "".join(o.outputs[0].text for o in steps) == c.text
    out, _ = stream(engine, prompt, greedy(16, stop_token_ids=[stop_id],
                                           include_stop_str_in_output=True))
    assert out.outputs[0].text == text_of(tokenizer, expected[:k + 1])

    # EOS: a special token whose text shows only with skip_special_tokens=False -- and even
    # then not when it ended the sequence.
    eos_tokenizer = PieceTokenizer(special={stop_id: "<|im_end|>"})
    eos_engine = make_engine(tiny_model.with_config(eos_token_id=stop_id), eos_tokenizer,
                             num_kv_blocks=64, max_model_len=512)
    for skip in (True, False):
        out, _ = stream(eos_engine, prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                           skip_special_tokens=skip))
        c = out.outputs[0]
        assert c.token_ids == expected[:k + 1]
        assert (c.finish_reason, c.stop_reason) == ("stop", None)
        assert c.text == text_of(eos_tokenizer, expected[:k], skip)
        assert "<|im_end|>" not in c.text


def test_length_is_checked_before_eos(tiny_model):
    """vllm/v1/core/sched/utils.py check_stop: max_tokens (and max_model_len) first, so an EOS
    sampled as the last allowed token ends the sequence with "length" (and, not being a stop,
    its text is detokenized)."""
    prompt = np.random.default_rng(9).integers(3, TINY_VOCAB, 30).tolist()
    expected = reference_greedy(tiny_model, prompt, 16)
    k = _first_repeated_free(expected, 3)
    tokenizer = PieceTokenizer(special={expected[k]: "<eos>"})
    engine = make_engine(tiny_model.with_config(eos_token_id=expected[k]), tokenizer,
                         num_kv_blocks=64, max_model_len=512)
    out, _ = stream(engine, prompt, SamplingParams(temperature=0.0, max_tokens=k + 1,
                                                   skip_special_tokens=False))
    c = out.outputs[0]
    assert c.token_ids == expected[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    assert c.text == text_of(tokenizer, expected[:k + 1], False)


def _stop_string_reference(texts: list[str], stop: list[str], min_tokens: int,
                           include: bool) -> tuple[int, str, str] | None:
    """vLLM's stop-string rule over the texts after 1, 2, ... tokens: the first token k (1-based)
    with k > min_tokens at which some stop string has an occurrence ending in the text token k
    added, the strings tried in list order. Returns (k, stop string, final text) or None."""
    for k in range(min_tokens + 1, len(texts) + 1):
        before, text = texts[k - 2] if k >= 2 else "", texts[k - 1]
        for s in stop:
            starts = [i for i in range(len(text) - len(s) + 1)
                      if text.startswith(s, i) and i + len(s) > len(before)]
            if starts:
                end = starts[0] + (len(s) if include else 0)
                return k, s, text[:end]
    return None


def test_stop_strings_wait_for_min_tokens(tiny_model):
    """vllm/v1/engine/detokenizer.py IncrementalDetokenizer.update: stop strings are checked
    only once len(output) > min_tokens, and only for matches that end in text produced after
    the min_tokens-th token (stop_check_offset) -- a stop string completed by token min_tokens
    itself is passed over."""
    tokenizer = PieceTokenizer(seed=1)
    prompt = np.random.default_rng(4).integers(3, TINY_VOCAB, 9).tolist()
    tokens = reference_greedy(tiny_model, prompt, 60)
    texts = texts_after_each_token(tokenizer, tokens)
    # A 2-character stop string that token m completes and that occurs again later; with
    # min_tokens = m the old rule (checked from token min_tokens on) stopped at token m.
    for m in range(4, 40):
        stop = texts[m - 1][-2:]
        hit = _stop_string_reference(texts, [stop], m, False)
        if (len(texts[m - 1]) - len(texts[m - 2]) >= 1 and stop not in texts[m - 2]
                and hit is not None):
            break
    else:
        raise AssertionError("no stop string completed by token m and again later")
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    k, _, text = hit
    out, steps = stream(engine, prompt, greedy(60, stop=[stop], min_tokens=m))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.token_ids == tokens[:k] and k > m
    assert c.text == text
    assert all(text.startswith(t)
               for t in itertools.accumulate(o.outputs[0].text for o in steps))
    # Without min_tokens it stops at token m.
    out, _ = stream(engine, prompt, greedy(60, stop=[stop]))
    assert len(out.outputs[0].token_ids) == m
    assert _stop_string_reference(texts, [stop], 0, False)[0] == m


def test_min_tokens_masks_eos_even_with_ignore_eos(tiny_model):
    """vllm/sampling_params.py SamplingParams.update_from_generation_config (eos in
    _all_stop_token_ids whatever ignore_eos says) and
    vllm/v1/sample/logits_processor/builtin.py MinTokensLogitsProcessor: while
    len(output) < min_tokens, EOS gets -inf even with ignore_eos=True."""
    prompt = np.random.default_rng(9).integers(3, TINY_VOCAB, 30).tolist()
    ref = ReferenceModel(*tiny_model)
    logits = ref.forward(np.array(prompt))[-1]
    eos = int(np.argmax(logits))  # the greedy first token, made the EOS
    engine = make_engine(tiny_model.with_config(eos_token_id=eos), num_kv_blocks=64,
                         max_model_len=512)
    out = run_requests(engine, [
        (0, "masked", dict(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=6, min_tokens=2, ignore_eos=True))),
        (0, "free", dict(prompt_token_ids=prompt, sampling_params=greedy(6)))])
    assert out["free"].outputs[0].token_ids[0] == eos
    masked = out["masked"].outputs[0].token_ids
    assert len(masked) == 6 and eos not in masked[:2]
    if backend_of(tiny_model).exact_reference:
        second_best = int(np.argsort(-logits, kind="stable")[1])
        assert masked[0] == second_best


def test_two_stop_strings_completed_by_one_token_list_order_wins(tiny_model):
    """vllm/v1/engine/detokenizer.py check_stop_strings: the stop strings are tried in the
    order of `stop` and the first one found wins -- not the one that starts earliest."""
    tokenizer = PieceTokenizer(seed=3)
    prompt = np.random.default_rng(5).integers(3, TINY_VOCAB, 9).tolist()
    tokens = reference_greedy(tiny_model, prompt, 60)
    texts = texts_after_each_token(tokenizer, tokens)
    for k in range(2, len(texts)):
        before, text = texts[k - 2], texts[k - 1]
        if len(text) - len(before) < 2 or len(before) < 2:
            continue
        early = text[len(before) - 2:len(before) + 1]  # ends at the token's first character
        late = text[-3:]  # ends at its last
        if early != late and early not in before and late not in text[:-1]:
            break
    else:
        raise AssertionError("no token completing two distinct stop strings")
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    for stop in ([late, early], [early, late]):
        hit = _stop_string_reference(texts, stop, 0, False)
        assert hit == (k, stop[0], text[:text.find(stop[0], len(before) - 2)])
        out, _ = stream(engine, prompt, greedy(60, stop=stop))
        c = out.outputs[0]
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop[0], hit[2])
        assert c.token_ids == tokens[:k]


def test_stop_string_on_the_length_token_finishes_with_stop(tiny_model):
    """vllm/v1/engine/output_processor.py OutputProcessor.process_outputs: a stop string found
    in the detokenized text turns the finish reason into "stop" (stop_reason the string) even
    on the step where check_stop said "length"."""
    tokenizer = PieceTokenizer(seed=1)
    prompt = np.random.default_rng(4).integers(3, TINY_VOCAB, 9).tolist()
    tokens = reference_greedy(tiny_model, prompt, 30)
    texts = texts_after_each_token(tokenizer, tokens)
    # Token k completes the stop string (its last two characters) for the first time.
    k = next(k for k in range(5, 30) if texts[k - 1][-2:] not in texts[k - 2])
    stop = texts[k - 1][-2:]
    hit = _stop_string_reference(texts[:k], [stop], 0, False)
    assert hit is not None and hit[0] == k
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    out, _ = stream(engine, prompt, greedy(k, stop=[stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == hit[2] and len(c.token_ids) == k


# ---------------------------------------------------------------------------- logprobs

def test_logprobs_shape_rank_cumulative_and_prompt_logprobs(tiny_model):
    """vllm/v1/sample/sampler.py Sampler.gather_logprobs and vllm/v1/engine/logprobs.py
    LogprobsProcessor: per position {token_id: Logprob(logprob, rank, decoded_token)}, the
    sampled token first (rank = 1 + the number of tokens with a larger logprob), then the top-k
    with ranks 1..k (k or k + 1 entries); cumulative_logprob the running sum of the sampled
    logprobs (in a streaming delta: the total so far); prompt logprobs the same per prompt
    position, entry 0 None; decoded_token = tokenizer.decode([id])."""
    backend = backend_of(tiny_model)
    tokenizer = PieceTokenizer()
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    out, steps = stream(engine, PROMPT, params)
    c = out.outputs[0]
    lp = _log_softmax_rows(ReferenceModel(*tiny_model).forward(np.array(PROMPT + c.token_ids)))
    running = 0.0
    for step in steps:  # deltas: cumulative_logprob is the total so far
        for position, token in zip(step.outputs[0].logprobs, step.outputs[0].token_ids):
            running += position[token].logprob
        assert step.outputs[0].cumulative_logprob == pytest.approx(running, abs=1e-5)
    assert c.cumulative_logprob == pytest.approx(running, abs=1e-5)
    assert len(c.logprobs) == len(c.token_ids) == 8
    for i, (position, token) in enumerate(zip(c.logprobs, c.token_ids)):
        _check_position(position, token, lp[len(PROMPT) - 1 + i], 3, backend, tokenizer)
    prompt_lp = out.prompt_logprobs
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    for j in range(1, len(PROMPT)):
        _check_position(prompt_lp[j], PROMPT[j], lp[j - 1], 2, backend, tokenizer)
    # logprobs=0: the sampled token alone.
    out, _ = stream(engine, PROMPT, dataclasses.replace(params, logprobs=0, prompt_logprobs=None))
    assert all(list(p) == [t] for p, t in zip(out.outputs[0].logprobs,
                                              out.outputs[0].token_ids))


def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    return np.stack([_log_softmax(row) for row in logits])


def _check_position(position: dict, token: int, ref_row: np.ndarray, k: int, backend,
                    tokenizer) -> None:
    """One position's dict against the reference log-softmax row."""
    items = list(position.items())
    assert items[0][0] == token
    entry = position[token]
    assert abs(entry.logprob - ref_row[token]) < backend.logprob_atol
    assert entry.decoded_token == tokenizer.decode([token])
    top = items[1:] if entry.rank > k else items
    assert len(position) == (k + 1 if entry.rank > k else k)
    ranked = sorted(top, key=lambda kv: kv[1].rank)
    assert [lp.rank for _, lp in ranked] == list(range(1, k + 1))
    assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in items)
    ref_top = np.sort(ref_row)[::-1][:k]
    assert np.allclose([lp.logprob for _, lp in ranked], ref_top, atol=backend.logprob_atol)
    if backend.exact_reference:
        assert entry.rank == 1 + int((ref_row > ref_row[token] + 1e-6).sum())
        assert [t for t, _ in ranked] == np.argsort(-ref_row, kind="stable")[:k].tolist()


def test_logprobs_mode_raw_and_processed(tiny_model):
    """vllm/v1/sample/sampler.py Sampler.forward (logprobs_mode): "raw_logprobs" (the default)
    is the log-softmax of the model's logits before any processing; "processed_logprobs" the
    log-softmax of the logits that are sampled from (after temperature and the top-k / top-p /
    min-p masks: masked tokens -inf)."""
    backend = backend_of(tiny_model)
    logits = ReferenceModel(*tiny_model).forward(np.array(PROMPT))[-1]
    params = SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=1, logprobs=3)
    raw = _log_softmax(logits)
    probs = reference_probs(logits, temperature=0.5, top_k=3)
    processed = np.full_like(probs, -np.inf)
    processed[probs > 0] = np.log(probs[probs > 0])
    # Dividing by the temperature doubles the logits' error on inexact backends.
    for mode, ref_row, atol in (("raw_logprobs", raw, backend.logprob_atol),
                                ("processed_logprobs", processed, backend.logprob_atol / 0.5)):
        engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=128,
                             logprobs_mode=mode)
        out, _ = stream(engine, PROMPT, params)
        (position,) = out.outputs[0].logprobs
        token = out.outputs[0].token_ids[0]
        assert np.isfinite(processed[token])
        for t, lp in position.items():
            assert abs(lp.logprob - ref_row[t]) < atol, (mode, t)
        if mode == "processed_logprobs":
            assert math.fsum(math.exp(lp.logprob) for lp in position.values()) == \
                pytest.approx(1.0, abs=1e-3)


def test_logprobs_above_max_logprobs_refused(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.verify: logprobs / prompt_logprobs (-1: the
    vocabulary) above the engine's max_logprobs (default 20; -1: the vocabulary) are refused,
    with vLLM's messages. Without logprobs, cumulative_logprob is None."""
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    assert code_and_message(engine, sampling_params=SamplingParams(logprobs=21)) == (
        "invalid_request", "Requested sample logprobs of 21, which is greater than max "
                           "allowed: 20")
    assert code_and_message(engine, sampling_params=SamplingParams(prompt_logprobs=-1)) == (
        "invalid_request", f"Requested prompt logprobs of {TINY_VOCAB}, which is greater than "
                           "max allowed: 20")
    out, _ = stream(engine, PROMPT, greedy(2, logprobs=20))
    assert all(len(p) == 20 for p in out.outputs[0].logprobs)
    out, _ = stream(engine, PROMPT, greedy(2), "plain")
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    unbounded = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128,
                            max_logprobs=-1)
    out, _ = stream(unbounded, PROMPT, greedy(1, logprobs=-1))
    (position,) = out.outputs[0].logprobs
    assert len(position) == TINY_VOCAB
    assert sorted(lp.rank for lp in position.values()) == list(range(1, TINY_VOCAB + 1))


# ---------------------------------------------------------------------------- validation

def test_seed_minus_one_means_no_seed(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.__post_init__: seed == -1 becomes None."""
    params = SamplingParams(seed=-1, max_tokens=2)
    assert params.seed is None
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    out, _ = stream(engine, PROMPT, params)
    assert len(out.outputs[0].token_ids) == 2


def test_n_above_64_is_accepted(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams._verify_args: 1 <= n <= VLLM_MAX_N_SEQUENCES
    (16384). Ours additionally refuses, at admission, an n above max_num_seqs (the n sequences
    are forked together after the first token and could never all run): a documented
    difference."""
    params = SamplingParams(n=100, temperature=1.0, seed=3, max_tokens=1)
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128, max_num_seqs=128)
    out, _ = stream(engine, PROMPT, params)
    assert [c.index for c in out.outputs] == list(range(100))
    with pytest.raises(SamplingParamsError, match="n"):
        SamplingParams(n=16385, temperature=1.0)
    small = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128, max_num_seqs=64)
    code, message = code_and_message(small, sampling_params=params)
    assert code == "capacity" and "max_num_seqs" in message


def test_repetition_penalty_above_10_is_accepted(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams._verify_args: repetition_penalty > 0, no upper
    bound (ours keeps a lower bound of 0.01: documented difference)."""
    params = SamplingParams(repetition_penalty=25.0, temperature=0.0, max_tokens=4)
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    out, _ = stream(engine, PROMPT, params)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(SamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)


def test_logprobs_true_means_one(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.__post_init__: logprobs=True and
    prompt_logprobs=True mean 1."""
    params = SamplingParams(logprobs=True, prompt_logprobs=True, temperature=0.0, max_tokens=2)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    out, _ = stream(engine, PROMPT, params)
    assert all(len(p) == 1 for p in out.outputs[0].logprobs)  # greedy: rank 1 is the token
    assert all(len(p) in (1, 2) for p in out.prompt_logprobs[1:])


def test_out_of_vocab_and_negative_stop_token_ids_refused_with_vllms_message(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.verify (_validate_stop_token_ids): stop ids
    outside [0, vocab) are refused at admission, with vLLM's message; the constructor accepts
    any integer."""
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    params = SamplingParams(stop_token_ids=[5, -1, TINY_VOCAB])
    code, message = code_and_message(engine, sampling_params=params)
    assert code == "invalid_request"
    assert message == (f"token_id(s) [-1, {TINY_VOCAB}] in stop_token_ids contain "
                       f"out-of-vocab token ids. Vocabulary size: {TINY_VOCAB}")


def test_temperature_above_2_is_refused():
    """vllm/sampling_params.py SamplingParams._verify_args: temperature in [0, 2]."""
    assert SamplingParams(temperature=2.0).temperature == 2.0
    for bad in (2.01, 100.0, float("inf"), float("nan"), -0.5):
        with pytest.raises(SamplingParamsError, match="temperature"):
            SamplingParams(temperature=bad)


def test_n_above_1_with_greedy_is_refused():
    """vllm/sampling_params.py SamplingParams._verify_greedy_sampling: n must be 1 when
    using greedy sampling."""
    with pytest.raises(SamplingParamsError, match="must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0.0)


def test_temperature_below_0_01_is_raised_to_0_01(tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.__post_init__: 0 < temperature < 0.01 becomes
    0.01 (_MAX_TEMP) -- sampled, not greedy; only 0 is greedy."""
    for tiny_temperature in (1e-3, 1e-6, 1e-300):
        params = SamplingParams(temperature=tiny_temperature)
        assert params.temperature == 0.01 and not params.greedy
    engine = make_engine(tiny_cpu_model, num_kv_blocks=32, max_model_len=128)
    a, _ = stream(engine, PROMPT, SamplingParams(temperature=1e-4, seed=8, max_tokens=6), "a")
    b, _ = stream(engine, PROMPT, SamplingParams(temperature=0.01, seed=8, max_tokens=6), "b")
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_children_of_n_use_seed_plus_j(tiny_model):
    """vllm/v1/engine/parallel_sampling.py ParentRequest (get_child_info): child j of a
    seeded n > 1 request samples with seed + j, so it equals an n = 1 request with seed + j."""
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=256)
    base = SamplingParams(temperature=1.0, seed=40, max_tokens=6, ignore_eos=True)
    requests = [(0, "parent", dict(prompt_token_ids=PROMPT,
                                   sampling_params=dataclasses.replace(base, n=3)))]
    requests += [(0, f"solo{j}", dict(prompt_token_ids=PROMPT, sampling_params=dataclasses.replace(
        base, seed=40 + j))) for j in range(3)]
    out = run_requests(engine, requests)
    assert [c.token_ids for c in out["parent"].outputs] == [
        out[f"solo{j}"].outputs[0].token_ids for j in range(3)]
    assert len({tuple(c.token_ids) for c in out["parent"].outputs}) > 1


# ---------------------------------------------------------------------------- new fields

@pytest.mark.parametrize("key", ["\u0661\u0662", " 12 ", "1_0", "012", "+12", "12.0", True, 1.0])
def test_logit_bias_keys_are_token_ids_in_decimal_digits(key):
    """int() takes every one of these keys (issue 36); a token id is an int or its canonical
    decimal text, so no two spellings name one token."""
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={key: 1.0})


def test_logit_bias_names_each_token_once():
    assert SamplingParams(logit_bias={"12": 1.0, 7: -1.0, "-3": 0.5}).logit_bias == {
        12: 1.0, 7: -1.0, -3: 0.5}
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={12: 1.0, "12": 2.0})


def test_logit_bias(tiny_model):
    """vllm/v1/sample/logits_processor/builtin.py LogitBiasLogitsProcessor: the bias is added
    to the logits before penalties and sampling (raw logprobs do not see it); keys outside
    the vocabulary are refused at admission (SamplingParams.verify, vLLM's message)."""
    logits = ReferenceModel(*tiny_model).forward(np.array(PROMPT))[-1]
    target = int(np.argsort(-logits, kind="stable")[40])  # far from the top
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=256)
    out, _ = stream(engine, PROMPT, greedy(4, logit_bias={target: 100.0}, logprobs=0))
    c = out.outputs[0]
    assert c.token_ids == [target] * 4
    assert abs(c.logprobs[0][target].logprob - _log_softmax(logits)[target]) < \
        backend_of(tiny_model).logprob_atol
    code, message = code_and_message(engine, sampling_params=SamplingParams(
        logit_bias={3: 1.0, TINY_VOCAB + 2: 1.0}))
    assert code == "invalid_request" and message == (
        f"token_id(s) [{TINY_VOCAB + 2}] in logit_bias contain out-of-vocab token ids. "
        f"Vocabulary size: {TINY_VOCAB}")


def test_allowed_token_ids(tiny_model):
    """vllm/v1/sample/sampler.py Sampler.forward (allowed_token_ids_mask): every other token
    gets -inf; an empty list and out-of-vocab ids are refused (SamplingParams._verify_args /
    verify, vLLM's messages)."""
    allowed = [7, 99, 250, 301]
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=256)
    out, _ = stream(engine, PROMPT, SamplingParams(n=4, temperature=1.5, seed=2, max_tokens=8,
                                                   ignore_eos=True, allowed_token_ids=allowed))
    drawn = {t for c in out.outputs for t in c.token_ids}
    assert drawn <= set(allowed) and len(drawn) > 1
    with pytest.raises(SamplingParamsError, match="allowed_token_ids: is not None and empty!"):
        SamplingParams(allowed_token_ids=[])
    assert code_and_message(engine, sampling_params=SamplingParams(
        allowed_token_ids=[3, TINY_VOCAB])) == (
        "invalid_request", "allowed_token_ids contains out-of-vocab token id!")


def test_truncate_prompt_tokens(tiny_model):
    """vllm/entrypoints/utils.py _validate_truncation_size and the prompt truncation it guards
    (truncate_prompt_tokens): the prompt is cut to its last k tokens before the length checks;
    -1 means max_model_len; a k above max_model_len is refused."""
    prompt = np.random.default_rng(1).integers(3, TINY_VOCAB, 100).tolist()
    engine = make_engine(tiny_model, num_kv_blocks=64, max_model_len=80)
    out, _ = stream(engine, prompt, greedy(3, truncate_prompt_tokens=12))
    assert out.prompt_token_ids == prompt[-12:]
    assert out.outputs[0].token_ids == reference_greedy(tiny_model, prompt[-12:], 3)
    assert out.usage.prompt_tokens == 12
    out, _ = stream(engine, prompt, greedy(1, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == prompt[-80:]
    assert code_and_message(engine, prompt_token_ids=prompt)[0] == "prompt_too_long"
    code, message = code_and_message(engine, sampling_params=greedy(1, truncate_prompt_tokens=81))
    assert code == "invalid_request" and "max_model_len" in message


def test_output_kind_delta_cumulative_final_only(tiny_model):
    """vllm/sampling_params.py RequestOutputKind and vllm/v1/engine/output_processor.py
    RequestState.make_request_output: CUMULATIVE hands out everything so far at every step,
    DELTA only what is new, FINAL_ONLY one output when the request finishes. (Our default is
    DELTA, vLLM's CUMULATIVE: documented difference.) LLM.generate returns the same whatever
    output_kind the caller's params carry, and leaves the caller's object alone."""
    tokenizer = PieceTokenizer()
    base = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=7, ignore_eos=True,
                          logprobs=1, prompt_logprobs=1, stop=["zzzz"])
    assert SamplingParams().output_kind == RequestOutputKind.DELTA

    def run(kind):  # one engine each: identical batches, so identical numbers
        engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=256)
        engine.add_request("r", prompt_token_ids=PROMPT,
                           sampling_params=dataclasses.replace(base, output_kind=kind))
        outputs = []
        for step in itertools.count():
            if not engine.has_unfinished_requests():
                return outputs
            outputs += [(step, out) for out in engine.step()]

    deltas = run(RequestOutputKind.DELTA)
    merged, merged_by_step = None, {}
    for step, out in deltas:
        merged = _merge(merged, out)
        merged_by_step[step] = _snapshot(merged)
    cumulative = run(RequestOutputKind.CUMULATIVE)
    assert [s for s, _ in cumulative] == [s for s, _ in deltas]
    for step, out in cumulative:
        assert _snapshot(out) == merged_by_step[step]
    (final,) = run(RequestOutputKind.FINAL_ONLY)
    assert final[1].finished and _snapshot(final[1]) == _snapshot(merged)
    assert merged.finished and all(len(c.token_ids) == 7 for c in merged.outputs)

    for kind in RequestOutputKind:
        llm = LLM.from_engine(make_engine(tiny_model, tokenizer, num_kv_blocks=64,
                                          max_model_len=256))
        params = dataclasses.replace(base, output_kind=kind)
        (result,) = llm.generate([PROMPT], params)
        assert _snapshot(result) == _snapshot(merged)
        assert params.output_kind == kind


def _snapshot(out) -> tuple:
    """What a finished-or-not RequestOutput says, comparable with ==."""
    return (out.prompt_logprobs, [
        (c.index, list(c.token_ids), c.text, None if c.logprobs is None else list(c.logprobs),
         c.cumulative_logprob, c.finish_reason) for c in out.outputs])


def test_spaces_between_special_tokens_is_accepted(tiny_cpu_model):
    """vllm/sampling_params.py spaces_between_special_tokens: accepted; it only changes the
    text of slow (pure Python) tokenizers, and ours are fast ones, where vLLM v1 also leaves
    the text alone (vllm/v1/engine/detokenizer.py FastIncrementalDetokenizer)."""
    tokenizer = PieceTokenizer()
    engine = make_engine(tiny_cpu_model, tokenizer, num_kv_blocks=32, max_model_len=128)
    texts = [stream(engine, PROMPT, greedy(6, spaces_between_special_tokens=flag,
                                           skip_special_tokens=False), str(flag))[0]
             .outputs[0].text for flag in (True, False)]
    assert texts[0] == texts[1] != ""


def test_chat_options_need_messages(tiny_cpu_model):
    """vllm/entrypoints/llm.py LLM.chat: the chat options shape how messages are rendered;
    here given with a plain prompt they are refused (nothing to render)."""
    engine = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    code, message = code_and_message(engine, chat_options=ChatOptions(tools=[{"a": 1}]))
    assert code == "invalid_request" and "messages" in message
    with pytest.raises(ChatOptionsError, match="cannot both be True"):
        ChatOptions(add_generation_prompt=True, continue_final_message=True)


# ---------------------------------------------------------------------------- default model

@pytest.fixture(scope="module")
def smol():
    """The default model on cpu: an engine, an LLM over it, the dense reference, the
    tokenizer (one load: the engine and the reference share the weights)."""
    from pagedrun.runtime.default_model import default_model_dir
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig
    from pagedrun.runtime.errors import ModelLoadError
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.tokenizer import Tokenizer
    from pagedrun.runtime.weights import load_model_weights

    try:
        model_dir = default_model_dir(progress=False)
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
    config = ModelConfig.from_model_dir(model_dir)
    weights = load_model_weights(model_dir, config)
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=256, max_num_seqs=256,
                                    num_kv_blocks=64, max_num_batched_tokens=256),
                       model_config=config, weights=weights, tokenizer=tokenizer)
    return SimpleNamespace(engine=engine, llm=LLM.from_engine(engine), tokenizer=tokenizer,
                           reference=ReferenceModel(config, weights))


def test_bad_words_default_model(smol, tiny_cpu_model):
    """vllm/sampling_params.py SamplingParams.update_from_tokenizer (each word's ids, and
    the ids of " " + word when they start with another token in as many tokens) and
    vllm/v1/sample/ops/bad_words.py apply_bad_words (a word's last token is banned where the
    output ends with its other tokens). The caller's SamplingParams is not modified (one
    object serves every prompt of LLM.generate)."""
    tok = smol.tokenizer
    prompt = "The capital of France is"
    (plain,) = smol.llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))
    word = tok.decode(plain.outputs[0].token_ids[:1]).strip()  # "Paris"
    assert word
    params = SamplingParams(temperature=0.0, max_tokens=4, bad_words=[word])
    outs = smol.llm.generate([prompt, prompt + " the city of"], params)
    assert params.bad_words_token_ids is None  # the caller's object is untouched
    banned = [tok.encode(word, add_special_tokens=False)]
    spaced = tok.encode(" " + word, add_special_tokens=False)
    if spaced[0] != banned[0][0] and len(spaced) == len(banned[0]):
        banned.append(spaced)
    assert len(banned) == 2  # " Paris" is its own token in SmolLM2's vocabulary
    for out in outs:
        ids = out.outputs[0].token_ids
        for word_ids in banned:
            n = len(word_ids)
            assert all(ids[i:i + n] != word_ids for i in range(len(ids) - n + 1))
    assert outs[0].outputs[0].token_ids[0] != plain.outputs[0].token_ids[0]
    # Without a tokenizer there is no way to know a word's tokens.
    bare = make_engine(tiny_cpu_model, num_kv_blocks=16, max_model_len=128)
    code, message = code_and_message(bare, sampling_params=params)
    assert code == "invalid_request" and "bad_words" in message


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_template_override_default_model(smol):
    """vllm/entrypoints/llm.py LLM.chat(chat_template=...) and
    vllm/entrypoints/chat_utils.py apply_hf_chat_template: the request's template replaces the
    model's, rendered in the same sandboxed environment (a template reaching for Python
    internals fails)."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = smol.llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=1),
                           chat_template=template)
    assert out.prompt_token_ids == smol.tokenizer.encode(
        "[user] What is the capital of France?\n", add_special_tokens=False)
    with pytest.raises(RequestError, match="chat template"):
        smol.llm.chat(CHAT, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")


def test_add_generation_prompt_default_model(smol):
    """vllm/entrypoints/llm.py LLM.chat(add_generation_prompt=...): True appends the
    template's assistant header (SmolLM2: "<|im_start|>assistant\\n"), False leaves it out."""
    one = SamplingParams(temperature=0.0, max_tokens=1)
    with_prompt, without = (smol.llm.chat(CHAT, one, add_generation_prompt=flag)[0]
                            for flag in (True, False))
    header = smol.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert with_prompt.prompt_token_ids == without.prompt_token_ids + header
    assert smol.tokenizer.decode(without.prompt_token_ids).endswith(
        "What is the capital of France?<|im_end|>\n")


def test_continue_final_message_default_model(smol):
    """vllm/entrypoints/chat_utils.py apply_hf_chat_template(continue_final_message=True), as
    transformers renders it: no generation prompt, and the text ends right after the final
    (assistant) message's content, so generation continues it."""
    messages = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    (out,) = smol.llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=3),
                           add_generation_prompt=False, continue_final_message=True)
    prompt_text = smol.tokenizer.decode(out.prompt_token_ids)
    assert prompt_text.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ChatOptionsError):
        smol.llm.chat(messages, continue_final_message=True)  # add_generation_prompt too


def test_tools_reach_the_template_default_model(smol):
    """vllm/entrypoints/llm.py LLM.chat(tools=...): the tools become the template's `tools`
    variable (and chat_template_kwargs more variables)."""
    template = ("{% if tools %}TOOLS {{ tools | tojson }} {{ flavour }}\n{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    (out,) = smol.llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=1),
                           chat_template=template, tools=tools,
                           chat_template_kwargs={"flavour": "mild"})
    assert smol.tokenizer.decode(out.prompt_token_ids) == (
        'TOOLS [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}] '
        "mild\nWhat is the capital of France?")


DISTRIBUTION_CASES = {
    # The example: every filter on.
    "temperature-topk-topp-minp": dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
    # Penalty and bias: the repetition penalty hits the prompt's tokens, the bias (set in the
    # test) lifts the 13th most likely token.
    "penalty-bias-topp-minp": dict(temperature=1.3, top_p=0.8, min_p=0.02,
                                   repetition_penalty=1.3),
}
NUM_DISTRIBUTION_REQUESTS = 8  # x DRAWS_PER_REQUEST = 2048 draws per case


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_first_token_distribution_default_model(smol, case):
    """vllm/v1/sample/sampler.py Sampler.forward through the whole engine on the default
    model: 2048 seeded first tokens against the distribution computed here from the dense
    reference's logits with vLLM's rules (reference_probs: bias, penalties, temperature,
    min_p, top_k, top_p); the check would catch min_p moved last, or the penalty and bias
    left out."""
    prompt = smol.tokenizer.encode("My favourite animal is the")
    logits = smol.reference.forward(np.array(prompt))[-1]
    knobs = dict(DISTRIBUTION_CASES[case])
    if "repetition_penalty" in knobs:
        knobs["logit_bias"] = {int(np.argsort(-logits, kind="stable")[12]): 3.0}
    assert_support_is_stable(logits, 1e-3, seen_token_ids=prompt, **knobs)
    expected = reference_probs(logits, seen_token_ids=prompt, **knobs)
    num_draws = NUM_DISTRIBUTION_REQUESTS * DRAWS_PER_REQUEST
    assert_can_tell_apart(expected, reference_probs(
        logits, seen_token_ids=prompt, **knobs, order="top_k,top_p,min_p"), num_draws)
    if "logit_bias" in knobs:
        plain = {k: v for k, v in knobs.items() if k not in ("logit_bias", "repetition_penalty")}
        assert_can_tell_apart(expected, reference_probs(logits, **plain), num_draws)
    params = SamplingParams(n=DRAWS_PER_REQUEST, seed=1000, **knobs)
    draws = first_token_draws(smol.engine, prompt, params, NUM_DISTRIBUTION_REQUESTS)
    assert_matches_distribution(draws, expected)
