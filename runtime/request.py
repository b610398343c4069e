"""Request state on the engine side: one user request (a prompt, n sequences) and its sequences.

The scheduler knows each sequence only as an int id, its token ids and its KV blocks; everything
about sampling, stopping, detokenizing and streaming lives here. A request with n > 1 starts as
one scheduler sequence (the parent, index 0); its siblings are forked from it right after the
prompt's first token is sampled, so all n share the prompt's KV blocks.

What a step hands back for a request follows its `output_kind` (vLLM's RequestOutputKind):
DELTA -- what is new since the last output (the engine's default: see docs/engine_api.md);
CUMULATIVE -- everything so far; FINAL_ONLY -- nothing until the request has finished.

Text: a sequence with stop strings is detokenized by the engine token by token (the stop strings
read the text, and the stream holds back what could become one); any other sequence's outputs
carry marks into a DeferredText instead, and the detokenizer runs when their `text` is read
(stop_checker.needs_text), which gives the same text.

`take_outputs` makes a step's outputs: the common request's inline (one sequence, DELTA,
deferred text), every other through its take_output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from pagedrun.runtime.detokenizer import FINAL_MARK, DeferredText
from pagedrun.runtime.outputs import (CompletionOutput, PositionLogprobs, PromptLogprobs,
                                      RequestOutput, Usage)
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagedrun.runtime.stop_checker import needs_text, stream_holdback_chars

# The output kinds as plain ints, for the check every request makes at every step (an enum
# member lookup costs more than the comparison).
_DELTA = int(RequestOutputKind.DELTA)
_FINAL_ONLY = int(RequestOutputKind.FINAL_ONLY)


@dataclass
class Sequence:
    """One of the n completions of a request (one scheduler request id)."""

    seq_id: int  # scheduler request id
    index: int  # CompletionOutput.index
    generator: np.random.Generator | None  # None: draws from the engine sampler's stream
    detokenizer: object  # pagedrun.runtime.detokenizer incremental detokenizer
    output_token_ids: list[int] = field(default_factory=list)
    # Per generated token {token_id: Logprob}, the sampled token first (None: not asked for).
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs
    text: str = ""  # visible text: everything detokenized, cut at a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Streaming cursors: how much of output_token_ids / logprobs / text the caller has seen.
    num_tokens_emitted: int = 0
    num_chars_emitted: int = 0
    # Deferred text (no stop strings): the sequence's DeferredText, made on its first output;
    # the mark the last output's text ended at; and, once the engine has ended the sequence,
    # how many output tokens its text covers (the token stop rules may leave the last one out).
    deferred_text: DeferredText | None = None
    text_mark: int = 0
    final_text_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_output(self, holdback_chars: int, cumulative: bool,
                    defer_text: bool = False) -> CompletionOutput:
        """What is new since the last call (or, `cumulative`, everything so far); text within
        `holdback_chars` of the end waits (it could become part of a stop string) unless the
        sequence has finished. cumulative_logprob is always the total so far. `defer_text`:
        the engine has not detokenized the sequence, and the output's text is made when read
        (between the last output's mark and this one's; nothing is held back)."""
        token_ids = self.output_token_ids
        num_tokens = len(token_ids)
        first_token = 0 if cumulative else self.num_tokens_emitted
        logprobs = self.logprobs
        detokenizer = self.detokenizer
        # Positional: this runs for every sequence at every step (a keyword call costs more).
        out = CompletionOutput(
            self.index, token_ids[first_token:], "",
            None if logprobs is None else logprobs[first_token:],
            None if logprobs is None else self.cumulative_logprob,
            self.finish_reason, self.stop_reason)
        self.num_tokens_emitted = num_tokens
        if defer_text and detokenizer is not None:
            deferred = self.deferred_text
            if deferred is None:
                deferred = self.deferred_text = DeferredText(detokenizer, token_ids)
            if self.final_text_tokens is None:
                end = num_tokens
            else:  # ended by the engine: its held bytes come out too
                deferred.final_num_tokens = self.final_text_tokens
                end = FINAL_MARK
            start = 0 if cumulative else self.text_mark
            if start != end:  # (a delta without new tokens keeps "")
                out.deferred_text = (deferred, start, end)
            self.text_mark = end
            return out
        text = self.text
        text_end = len(text) if self.finish_reason is not None else max(
            self.num_chars_emitted, len(text) - holdback_chars)
        out.text = text[0 if cumulative else self.num_chars_emitted:text_end]
        self.num_chars_emitted = text_end
        return out


@dataclass
class Request:
    """A user request: one prompt, `params.n` sequences, timing and usage."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    # Siblings 1..n-1 are created (and forked in the scheduler) when the parent samples its
    # first token; until then seqs holds only the parent.
    forked: bool = False
    # Set by the engine once every sequence has finished (or the request was aborted).
    finished: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0
    # prompt_logprobs[i] is for prompt token i (None for token 0, which has no context).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_emitted: bool = False
    error: str | None = None
    # Pipeline parallelism: the virtual engine (scheduler and KV pools) the request runs on.
    virtual_engine: int = 0
    # The engine's per-token stop test, made on the first sampled token: (length_limit,
    # stop_ids) from stop_checker.token_stop_bounds, or False when every token takes the full
    # path (stop strings: the text is detokenized and searched at every token).
    token_stops: tuple[int, frozenset[int]] | bool | None = None
    # Whether take_outputs may build this request's outputs inline: one sequence, DELTA
    # outputs, no prompt logprobs, text the engine does not decode (a tokenizer, no stop
    # strings); made on the first output (None: not yet).
    inline_output: bool | None = None

    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), self.num_cached_prompt_tokens,
                     sum(len(s.output_token_ids) for s in self.seqs))

    def take_output(self) -> RequestOutput | None:
        """This step's output for the request's output_kind (None: nothing to hand out yet, a
        FINAL_ONLY request still running). Prompt logprobs come once the whole prompt has
        run: on the first DELTA, on every CUMULATIVE output, on the FINAL_ONLY one."""
        params = self.params
        kind = params.output_kind
        finished = self.finished
        if kind == _FINAL_ONLY and not finished:
            return None
        cumulative = kind != _DELTA
        defer_text = not needs_text(params)
        holdback = 0 if defer_text else stream_holdback_chars(params)
        prompt_logprobs = None
        if (self.prompt_logprobs is not None and (cumulative or not self.prompt_logprobs_emitted)
                and len(self.prompt_logprobs) == len(self.prompt_token_ids)):
            prompt_logprobs = list(self.prompt_logprobs)
            self.prompt_logprobs_emitted = True
        seqs = self.seqs
        if len(seqs) == 1:  # usage() without its generator: this runs for every request
            seq = seqs[0]
            completions = [seq.take_output(holdback, cumulative, defer_text)]
            usage = Usage(len(self.prompt_token_ids), self.num_cached_prompt_tokens,
                          len(seq.output_token_ids))
        else:
            completions = [s.take_output(holdback, cumulative, defer_text) for s in seqs]
            usage = self.usage()
        # Positional, in RequestOutput's field order (a keyword call costs twice as much).
        return RequestOutput(self.request_id, self.prompt_token_ids, completions, finished,
                             usage, prompt_logprobs, self.arrival_time,
                             self.first_scheduled_time, self.first_token_time,
                             self.finished_time, self.error)


def take_outputs(requests: Iterable[Request]) -> list[RequestOutput]:
    """The step's outputs: `take_output()` of each request, the Nones (FINAL_ONLY requests
    still running) left out. This runs for every running request at every step, so the common
    request -- one sequence, DELTA outputs, deferred text, no prompt logprobs -- is built here
    inline, exactly as Request.take_output and Sequence.take_output(0, False, True) build it
    (tests/engine/test_take_outputs.py holds the two to the same outputs); any other goes
    through take_output."""
    outputs = []
    append = outputs.append
    for request in requests:
        inline = request.inline_output
        if inline is None:  # (what it depends on is fixed at admission)
            params = request.params
            inline = request.inline_output = (
                params.output_kind == _DELTA and not needs_text(params) and params.n == 1
                and request.prompt_logprobs is None and len(request.seqs) == 1
                and request.seqs[0].detokenizer is not None)
        if not inline:
            output = request.take_output()
            if output is not None:
                append(output)
            continue
        seq = request.seqs[0]
        token_ids = seq.output_token_ids
        num_tokens = len(token_ids)
        first_token = seq.num_tokens_emitted
        logprobs = seq.logprobs
        completion = CompletionOutput(
            seq.index, token_ids[first_token:], "",
            None if logprobs is None else logprobs[first_token:],
            None if logprobs is None else seq.cumulative_logprob,
            seq.finish_reason, seq.stop_reason)
        seq.num_tokens_emitted = num_tokens
        deferred = seq.deferred_text
        if deferred is None:
            deferred = seq.deferred_text = DeferredText(seq.detokenizer, token_ids)
        final_text_tokens = seq.final_text_tokens
        if final_text_tokens is None:
            end = num_tokens
        else:  # ended by the engine: its held bytes come out too
            deferred.final_num_tokens = final_text_tokens
            end = FINAL_MARK
        start = seq.text_mark
        if start != end:  # (a delta without new tokens keeps "")
            completion.deferred_text = (deferred, start, end)
        seq.text_mark = end
        prompt_token_ids = request.prompt_token_ids
        append(RequestOutput(request.request_id, prompt_token_ids, [completion], request.finished,
                             Usage(len(prompt_token_ids), request.num_cached_prompt_tokens,
                                   num_tokens), None, request.arrival_time,
                             request.first_scheduled_time, request.first_token_time,
                             request.finished_time, request.error))
    return outputs

