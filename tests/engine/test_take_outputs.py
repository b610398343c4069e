"""request.take_outputs builds the common request's output inline (one sequence, DELTA, deferred
text, no prompt logprobs): on random histories of random requests it must hand out exactly
what each request's own take_output does -- token ids, text (read after every step, or only at
the end), logprobs, finish and stop reasons, usage, timing -- and leave the same state behind."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from engine_helpers import TINY_VOCAB, PieceTokenizer
from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.outputs import Logprob
from pagedrun.runtime.request import Request, Sequence, take_outputs
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
         RequestOutputKind.FINAL_ONLY]


def _request(rng: np.random.Generator, i: int, tokenizer) -> Request:
    n = int(rng.choice([1, 1, 1, 2]))
    params = SamplingParams(n=n, output_kind=KINDS[int(rng.integers(len(KINDS)))],
                            stop=["ab"] if rng.random() < 0.2 else None,
                            logprobs=0 if rng.random() < 0.3 else None,
                            prompt_logprobs=0 if rng.random() < 0.1 else None)
    prompt = rng.integers(3, TINY_VOCAB, int(rng.integers(1, 8))).tolist()
    request = Request(f"r{i}", prompt, params, float(i))
    if params.prompt_logprobs is not None:
        request.prompt_logprobs = [None] + [{t: Logprob(-1.0)} for t in prompt[1:]]
    detokenized = rng.random() < 0.9  # else: an engine without a tokenizer
    for index in range(n):
        detok = (IncrementalDetokenizer(tokenizer, prompt) if detokenized else None)
        request.seqs.append(Sequence(i * 10 + index, index, None, detok,
                                     logprobs=[] if params.logprobs is not None else None))
    return request


def _advance(rng: np.random.Generator, request: Request, step: int) -> None:
    """What an engine step may do to a request: tokens (with logprobs), an end, timing."""
    if request.finished:
        return
    request.first_scheduled_time = request.first_scheduled_time or step + 0.5
    for seq in request.seqs:
        if seq.finished or rng.random() < 0.2:
            continue
        token = int(rng.integers(0, TINY_VOCAB))
        seq.output_token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append({token: Logprob(-0.5, 1, None)})
            seq.cumulative_logprob -= 0.5
        if request.params.stop:  # the engine decodes these as it goes
            seq.text += seq.detokenizer.add_token(token) if seq.detokenizer else ""
        request.first_token_time = request.first_token_time or step + 0.7
        if rng.random() < 0.15:
            seq.finish_reason, seq.stop_reason = ("stop", token) if rng.random() < 0.5 else (
                "length", None)
            # The token stop rules may leave the last token's text out.
            seq.final_text_tokens = len(seq.output_token_ids) - int(rng.random() < 0.5)
    if all(s.finished for s in request.seqs):
        request.finished, request.finished_time = True, step + 0.9


def _key(output) -> tuple:
    return (output.request_id, output.prompt_token_ids, output.finished, output.usage,
            output.prompt_logprobs, output.arrival_time, output.first_scheduled_time,
            output.first_token_time, output.finished_time, output.error,
            [(c.index, c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason,
              c.stop_reason) for c in output.outputs])


@pytest.mark.parametrize("read_every_step", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_take_outputs_equals_each_take_output(seed, read_every_step):
    rng = np.random.default_rng(seed)
    tokenizer = PieceTokenizer()
    requests = [_request(rng, i, tokenizer) for i in range(60)]
    twins = copy.deepcopy(requests)
    assert sum(r.params.output_kind == RequestOutputKind.DELTA and not r.params.stop
               and len(r.seqs) == 1 and r.prompt_logprobs is None for r in requests) >= 8
    got_all, want_all = [], []
    for step in range(30):
        state = rng.bit_generator.state
        for request in requests:
            _advance(rng, request, step)
        rng.bit_generator.state = state
        for request in twins:
            _advance(rng, request, step)
        got = take_outputs(requests)
        want = [o for o in (r.take_output() for r in twins) if o is not None]
        if read_every_step:
            assert [_key(o) for o in got] == [_key(o) for o in want], step
        got_all += got
        want_all += want
    # Text read only now, after every later token was added: the marks still say which.
    assert [_key(o) for o in got_all] == [_key(o) for o in want_all]
    assert any(o.finished for o in got_all) and any(not o.finished for o in got_all)
    for a, b in zip(requests, twins):
        for sa, sb in zip(a.seqs, b.seqs):
            assert (sa.num_tokens_emitted, sa.text_mark, sa.num_chars_emitted) == (
                sb.num_tokens_emitted, sb.text_mark, sb.num_chars_emitted)


def test_completion_output_constructor_is_the_dataclass_one():
    """CompletionOutput's hand-written __init__ (it skips the `text` property's call) takes
    the dataclass's fields, in order, with their defaults."""
    import dataclasses
    import inspect

    from pagedrun.runtime.outputs import CompletionOutput

    names = [f.name for f in dataclasses.fields(CompletionOutput)]
    assert list(inspect.signature(CompletionOutput).parameters) == names
    a, b = CompletionOutput(3), CompletionOutput(3)
    assert a.token_ids == [] and a.token_ids is not b.token_ids  # a new list each
    assert (a.text, a.logprobs, a.cumulative_logprob, a.finish_reason, a.stop_reason) == (
        "", None, None, None, None)
    args = (1, [5, 6], "hi", [{5: Logprob(-1.0)}], -1.0, "stop", 6)
    c = CompletionOutput(*args)
    assert c == CompletionOutput(**dict(zip(names, args)))
    assert [getattr(c, n) for n in names] == list(args) and c.deferred_text is None
    assert dataclasses.replace(c, text="x").text == "x"
