"""SpeculativeConfig: what `LLM(speculative_config={...})` and `--speculative-config JSON`
configure, with vLLM's field names (vllm/config SpeculativeConfig).

    method                  "ngram" (prompt lookup) or "draft_model" (a smaller model that
                            shares the tokenizer); None with `model` set means "draft_model"
    num_speculative_tokens  k, the most tokens proposed per request per step (>= 1, required)
    prompt_lookup_max       ngram: the longest n-gram matched (>= 1)
    prompt_lookup_min       ngram: the shortest n-gram matched (1 <= min <= max)
    model                   draft_model: the draft's path (required there, refused for ngram)
    disable_by_batch_size   a step whose running decoding sequences number this many or more
                            runs without speculation (a large batch is compute-bound, and
                            verifying k extra tokens per request costs more than it saves);
                            None: the backend's default (4 on the cpu backends, none on
                            sim/cuda); >= 1 when given

As vLLM does for "ngram": when neither lookup bound is given both default to
DEFAULT_PROMPT_LOOKUP; when one is given the other copies it. Messages start with the field's
name so the CLI can print them as they are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's default n-gram length when the config names neither bound.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfigError(ValueError):
    """A speculative_config value is invalid; the message names the field."""


@dataclass
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "draft_model"
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"method: must be one of {list(METHODS)} (or omitted with a draft 'model'), "
                f"got {self.method!r}")
        _need_int(self.num_speculative_tokens, "num_speculative_tokens", minimum=1)
        if self.disable_by_batch_size is not None:
            _need_int(self.disable_by_batch_size, "disable_by_batch_size", minimum=1)
        if self.method == "ngram":
            self._fill_lookup_bounds()
            if self.model is not None:
                raise SpeculativeConfigError(
                    f"model: the ngram method takes no draft model, got {self.model!r}")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise SpeculativeConfigError(
                    "model: the draft_model method needs the draft model's path")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise SpeculativeConfigError(
                        f"{name}: only the ngram method looks up the prompt")

    def _fill_lookup_bounds(self) -> None:
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        _need_int(self.prompt_lookup_max, "prompt_lookup_max", minimum=1)
        _need_int(self.prompt_lookup_min, "prompt_lookup_min", minimum=1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min: must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From the parsed `speculative_config` dict; unknown keys are refused by name."""
        if not isinstance(values, dict):
            raise SpeculativeConfigError(
                f"speculative_config: must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From the text of `--speculative-config JSON`."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"speculative_config: not valid JSON ({exc})") from None
        return cls.from_dict(values)


def _need_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"{name}: must be an integer, got {value!r}")
    if value < minimum:
        raise SpeculativeConfigError(f"{name}: must be >= {minimum}, got {value}")
