"""SamplingParams: what a request asks of the sampler and of the stop checks (vLLM's names).

Validation lives here so the engine, the offline API and the server reject bad values with the
same message. Every field is plain data (msgpack-friendly) so the wire protocol can carry it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Sampling with temperature below this is treated as greedy: dividing logits by a tiny
# temperature overflows float32 and the argmax is what the user meant anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# Upper bound on top-logprobs per token: beyond this the cost is a full sort per token.
MAX_LOGPROBS = 20
# Lower bound of repetition_penalty: a penalty near 0 divides positive logits past float32's
# range (inf), which every sampler would then have to survive; 0.01 already multiplies a seen
# token's logit by 100.
MIN_REPETITION_PENALTY = 0.01


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; the message names the field."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (chosen token always)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{name}: {what}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(is_int(self.n) and 1 <= self.n <= 64, "n", "must be an integer in [1, 64]")
        need(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
             "must be a number in [0, 100]")
        need(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (or -1)")
        need(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(is_num(self.repetition_penalty)
             and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
             "repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, 10]")
        need(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty", "must be in [-2, 2]")
        need(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty", "must be in [-2, 2]")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
             "must be None or an integer in [0, 2**63)")
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens", "must be None or an integer >= 1")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
             "must be an integer >= 0")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        need(all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be a list of non-empty strings")
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
                 f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "must be a boolean")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Build from a wire/JSON dict; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)
