"""What the engine hands back: per-step deltas (streaming) and finished results (offline API).

`RequestOutput` is the seam between the engine and its users (the offline `LLM`, the server):
neither side reads the other's internals.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry at one position (vLLM's vllm.logprobs.Logprob).

    rank: 1 + the number of tokens with a strictly larger logprob (the top-k entries get ranks
    1..k in order); decoded_token: the token's own text (tokenizer.decode([id])), None without
    a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token_id: Logprob}: the sampled (or prompt) token first, then the top-k (vLLM's
# shape: k or k + 1 entries, as the token is or is not among the top k).
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
PromptLogprobs = list[PositionLogprobs | None]  # entry 0 is None (token 0 has no context)


@dataclass
class TokenLogprobs:
    """What a sampler computes for one row, before detokenization: the chosen (or prompt)
    token's logprob and rank, and the top-k token ids with their logprobs, best first."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of the n sequences of a request.

    In a streaming delta, `token_ids`/`text`/`logprobs` hold only what is new this step;
    in a final (offline) output they hold everything generated.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs | None = None
    # Sum of the sampled tokens' logprobs so far (vLLM); None when logprobs were not asked for.
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # None while running; "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    # Not a field: (DeferredText, start mark, end mark), from which `text` is made when first
    # read (pagedrun.runtime.detokenizer: the engine leaves the detokenization of a sequence
    # without stop strings to whoever reads its text); None: `text` is as given.
    deferred_text = None

    def __getstate__(self) -> dict:  # copies and pickles carry the text itself
        state = dict(self.__dict__)
        state["_text"], state["deferred_text"] = self.text, None
        return state


def _completion_text(self: CompletionOutput) -> str:
    deferred = self.deferred_text
    if deferred is not None:
        owner, start, end = deferred
        self._text = owner.text(start, end)
        self.deferred_text = None
    return self._text


def _set_completion_text(self: CompletionOutput, text: str) -> None:
    self._text = text
    self.deferred_text = None


_NEW_LIST = object()  # CompletionOutput's token_ids default: a new list per object


def _completion_init(self: CompletionOutput, index: int, token_ids: list[int] = _NEW_LIST,
                     text: str = "", logprobs: SampleLogprobs | None = None,
                     cumulative_logprob: float | None = None, finish_reason: str | None = None,
                     stop_reason: int | str | None = None) -> None:
    # The dataclass's own __init__, less the call of the `text` property it would make (this
    # runs for every sequence at every step).
    self.index = index
    self.token_ids = [] if token_ids is _NEW_LIST else token_ids
    self._text = text
    self.logprobs = logprobs
    self.cumulative_logprob = cumulative_logprob
    self.finish_reason = finish_reason
    self.stop_reason = stop_reason


# After the dataclass is made: `text` stays a field (the constructor's third argument, in
# __eq__ and __repr__), read and written through the property.
CompletionOutput.text = property(_completion_text, _set_completion_text,
                                 doc="The text (of this delta, or all of it).")
CompletionOutput.__init__ = _completion_init


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    usage: Usage = field(default_factory=Usage)
    prompt_logprobs: PromptLogprobs | None = None
    # Timing, seconds (monotonic clock): arrival, first scheduled, first token, finish.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # set with finish_reason "error"
    # The prompt's text (vLLM's RequestOutput.prompt), filled by the offline LLM: the text
    # prompt, a chat's rendered template; None for token ids (and in the engine's own outputs).
    prompt: str | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds between arrival and the first step that scheduled the request (vLLM's
        request_queue_time_seconds)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time
