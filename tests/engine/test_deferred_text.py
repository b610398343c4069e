"""Deferred text (runtime/detokenizer.py DeferredText): a request without stop strings is not
detokenized inside the engine; each output's text is made when it is first read. It must be the
text the engine's own token-by-token detokenization gives: the oracle is the same request with
a one-character stop string that never matches (the engine then detokenizes every token, and a
one-character stop string holds nothing back from the stream).

A byte tokenizer makes incomplete UTF-8 characters (held back until a later token completes
them, U+FFFD when the sequence ends first); stop token ids and EOS test the stop token left out
of the text, include_stop_str_in_output it kept; aborts a sequence ended without finish().
"""
from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np

from engine_helpers import TINY_VOCAB, PieceTokenizer, greedy, make_engine
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams

# A stop string these runs never decode to (four exact bytes in a row from ByteTokenizer).
NEVER = "\U0010fffe"
EOS_ID = 2  # tiny_config's eos_token_id
PROMPT = np.random.default_rng(5).integers(3, TINY_VOCAB, 12).tolist()


class ByteTokenizer:
    """Ids 3..258 are the bytes 0..255 (decoded together as UTF-8, invalid runs U+FFFD); ids
    0-2 are special; the rest decode to one letter each."""

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for t in token_ids:
            if t < 3:
                if not skip_special_tokens:
                    out += b"<%d>" % t
            elif t < 259:
                out.append(t - 3)
            else:
                out += b"xyz"[t % 3:t % 3 + 1]
        return out.decode("utf-8", "replace")


def _run(model, tokenizer, requests, abort_at=None, read=True):
    """Step until done; (step, output) pairs in order. requests: (request_id, params).
    `abort_at`: (step, request_id) aborted before that step. `read`: read each text now."""
    engine = make_engine(model, tokenizer, num_kv_blocks=64, max_model_len=256)
    for request_id, params in requests:
        engine.add_request(request_id, prompt_token_ids=PROMPT, sampling_params=params)
    outputs = []
    for step in range(200):
        if not engine.has_unfinished_requests():
            return outputs
        if abort_at is not None and abort_at[0] == step:
            engine.abort_request(abort_at[1])
        for out in engine.step():
            if read:
                for c in out.outputs:
                    assert isinstance(c.text, str)
            outputs.append((step, out))
    raise AssertionError("engine did not finish")


def _snapshot(outputs):
    return [(step, out.request_id, out.finished, [
        (c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.logprobs,
         c.cumulative_logprob) for c in out.outputs]) for step, out in outputs]


def _with_stop(params, stop):
    return dataclasses.replace(params, stop=list(stop))


def _requests(tokens):
    """A mix of requests over every way a sequence ends, stop ids taken from the greedy run."""
    stop_id = tokens[4]
    return [
        ("length", greedy(9)),
        ("stop-id", greedy(20, stop_token_ids=[stop_id])),
        ("stop-id-kept", greedy(20, stop_token_ids=[stop_id], include_stop_str_in_output=True)),
        ("specials", greedy(7, skip_special_tokens=False, stop_token_ids=[stop_id])),
        ("min-tokens", greedy(12, stop_token_ids=[stop_id], min_tokens=6)),
        ("eos", SamplingParams(temperature=1.0, seed=3, max_tokens=30, logprobs=1,
                               logit_bias={EOS_ID: 4.0})),
        ("n2", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10,
                              stop_token_ids=[stop_id, tokens[2]])),
        ("cumulative", greedy(8, output_kind=RequestOutputKind.CUMULATIVE)),
        ("final-only", greedy(8, stop_token_ids=[stop_id],
                              output_kind=RequestOutputKind.FINAL_ONLY)),
        ("aborted", greedy(30)),
    ]


def test_deferred_text_is_the_engines_own_text(tiny_cpu_model):
    for tokenizer in (ByteTokenizer(), PieceTokenizer()):
        ((_, final),) = _run(tiny_cpu_model, tokenizer, [
            ("g", greedy(12, output_kind=RequestOutputKind.FINAL_ONLY))])
        tokens = final.outputs[0].token_ids
        requests = _requests(tokens)
        deferred = _run(tiny_cpu_model, tokenizer, requests, abort_at=(5, "aborted"))
        eager = _run(tiny_cpu_model, tokenizer, [(rid, _with_stop(p, [NEVER]))
                                                 for rid, p in requests],
                     abort_at=(5, "aborted"))
        assert _snapshot(deferred) == _snapshot(eager)
        texts = "".join(c.text for _, out in deferred for c in out.outputs)
        if isinstance(tokenizer, ByteTokenizer):
            assert "\ufffd" in texts  # incomplete characters were made and ended


def test_outputs_read_late_and_out_of_order(tiny_cpu_model):
    """Texts read only after the request finished, newest first, are the texts read at once."""
    tokenizer = ByteTokenizer()
    requests = [("a", greedy(15)), ("b", SamplingParams(n=2, temperature=1.0, seed=1,
                                                        max_tokens=12))]
    at_once = _snapshot(_run(tiny_cpu_model, tokenizer, requests))
    late = _run(tiny_cpu_model, tokenizer, requests, read=False)
    for _, out in reversed(late):
        for c in reversed(out.outputs):
            assert isinstance(c.text, str)
    assert _snapshot(late) == at_once


def test_copies_and_pickles_carry_the_text(tiny_cpu_model):
    outputs = _run(tiny_cpu_model, PieceTokenizer(), [("a", greedy(6))], read=False)
    first = outputs[0][1].outputs[0]
    copied = copy.deepcopy(first)
    unpickled = pickle.loads(pickle.dumps(outputs[1][1].outputs[0]))
    assert copied.deferred_text is None and unpickled.deferred_text is None
    assert copied == first and unpickled == outputs[1][1].outputs[0]
    assert "".join(out.outputs[0].text for _, out in outputs) != ""


def test_a_failing_decode_stops_the_text_and_not_the_reader(tiny_cpu_model, caplog):
    """The detokenizer now runs in the reader: a tokenizer that raises is logged and the text
    stops where it was (for that output and every later one); reading never raises."""
    tokenizer = PieceTokenizer()
    ((_, final),) = _run(tiny_cpu_model, tokenizer, [
        ("g", greedy(10, output_kind=RequestOutputKind.FINAL_ONLY))])
    tokens = final.outputs[0].token_ids
    bad = tokens[5]
    decode = tokenizer.decode

    def failing(token_ids, skip_special_tokens=False):
        if bad in token_ids:
            raise RuntimeError("no text for you")
        return decode(token_ids, skip_special_tokens)

    tokenizer.decode = failing
    outputs = _run(tiny_cpu_model, tokenizer, [("g", greedy(10))])
    assert "no text for you" in caplog.text
    texts = "".join(out.outputs[0].text for _, out in outputs)
    assert texts == decode(tokens[:tokens.index(bad)], True)
    assert outputs[-1][1].outputs[0].finish_reason == "length"
