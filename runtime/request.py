"""Request state on the engine side: one user request (a prompt, n sequences) and its sequences.

The scheduler knows each sequence only as an int id, its token ids and its KV blocks; everything
about sampling, stopping, detokenizing and streaming lives here. A request with n > 1 starts as
one scheduler sequence (the parent, index 0); its siblings are forked from it right after the
prompt's first token is sampled, so all n share the prompt's KV blocks.

What a step hands back for a request follows its `output_kind` (vLLM's RequestOutputKind):
DELTA -- what is new since the last output (the engine's default: see docs/engine_api.md);
CUMULATIVE -- everything so far; FINAL_ONLY -- nothing until the request has finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedrun.runtime.outputs import (CompletionOutput, PositionLogprobs, PromptLogprobs,
                                      RequestOutput, Usage)
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagedrun.runtime.stop_checker import stream_holdback_chars


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_output(self, holdback_chars: int, cumulative: bool) -> CompletionOutput:
        """What is new since the last call (or, `cumulative`, everything so far); text within
        `holdback_chars` of the end waits (it could become part of a stop string) unless the
        sequence has finished. cumulative_logprob is always the total so far."""
        text_end = len(self.text) if self.finished else max(
            self.num_chars_emitted, len(self.text) - holdback_chars)
        first_token = 0 if cumulative else self.num_tokens_emitted
        first_char = 0 if cumulative else self.num_chars_emitted
        out = CompletionOutput(
            index=self.index,
            token_ids=self.output_token_ids[first_token:],
            text=self.text[first_char:text_end],
            logprobs=None if self.logprobs is None else self.logprobs[first_token:],
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_tokens_emitted = len(self.output_token_ids)
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

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_token_ids),
                     cached_prompt_tokens=self.num_cached_prompt_tokens,
                     completion_tokens=sum(len(s.output_token_ids) for s in self.seqs))

    def _output(self, completions: list[CompletionOutput], prompt_logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            outputs=completions, finished=self.finished, usage=self.usage(),
            prompt_logprobs=prompt_logprobs, arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time, finished_time=self.finished_time,
            error=self.error)

    def take_output(self) -> RequestOutput | None:
        """This step's output for the request's output_kind (None: nothing to hand out yet, a
        FINAL_ONLY request still running). Prompt logprobs come once the whole prompt has
        run: on the first DELTA, on every CUMULATIVE output, on the FINAL_ONLY one."""
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        cumulative = kind != RequestOutputKind.DELTA
        holdback = stream_holdback_chars(self.params)
        prompt_logprobs = None
        if (self.prompt_logprobs is not None and (cumulative or not self.prompt_logprobs_emitted)
                and len(self.prompt_logprobs) == len(self.prompt_token_ids)):
            prompt_logprobs = list(self.prompt_logprobs)
            self.prompt_logprobs_emitted = True
        return self._output([s.take_output(holdback, cumulative) for s in self.seqs],
                            prompt_logprobs)
