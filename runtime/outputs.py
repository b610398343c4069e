"""What the engine hands back: per-step deltas (streaming) and finished results (offline API).

`RequestOutput` is the seam between the engine and its users (the offline `LLM`, the server):
neither side reads the other's internals.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one sampled token, plus the top-k alternatives at that position."""

    token_id: int
    logprob: float
    # token id -> logprob (top-k, k = params.logprobs)
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One of the n sequences of a request.

    In a streaming delta, `token_ids`/`text`/`logprobs` hold only what is new this step;
    in a final (offline) output they hold everything generated.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # None while running; "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched


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
    prompt_logprobs: list[Logprob | None] | None = None
    # Timing, seconds (monotonic clock): arrival, first token, finish.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # set with finish_reason "error"

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time
