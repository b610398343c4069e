"""SamplingParams: what a request asks of the sampler and of the stop checks (vLLM's names and
vLLM's rules, docs/engine_api.md "vLLM conformance").

Validation lives here so the engine, the offline API and the server reject bad values with the
same message. Checks that need the model (token ids against the vocabulary, logprobs against
the engine's `max_logprobs`, bad words against the tokenizer) happen at admission
(`LLMEngine.add_request`). Every wire field is plain data (msgpack-friendly) so the protocol can
carry it; `_bad_words_token_ids` is the engine's (set at admission, never on the wire). vLLM's
remaining commonly used fields are taken by the offline API but are not wire fields
(OFFLINE_ONLY_FIELDS): plugin data and a copy hint, and four that the engine cannot honour
beyond their default (NOT_HONOURED), refused with the reason rather than ignored.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import IntEnum

# Sampling with temperature below this is greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5
# Temperatures in (0, MIN_SAMPLING_TEMPERATURE) are raised to it (vLLM's _MAX_TEMP): dividing
# logits by a tinier temperature overflows float32.
MIN_SAMPLING_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0  # vLLM: temperature in [0, 2]

# Default of EngineConfig.max_logprobs (vLLM's default max_logprobs): top-logprobs per token.
MAX_LOGPROBS = 20
# vLLM's default VLLM_MAX_N_SEQUENCES.
MAX_N = 16384
# Lower bound of repetition_penalty (vLLM: > 0). A deliberate difference: a penalty below this
# divides positive logits past float32's range (inf), and the distribution degenerates to "the
# seen tokens share everything"; 0.01 already multiplies a seen token's logit by 100.
MIN_REPETITION_PENALTY = 0.01


# vLLM fields the offline API takes that the wire (docs/protocol.md) does not carry: each is
# either plugin data with no effect (extra_args), a copy hint (skip_clone), or accepted only at
# its default, so the server loses nothing by refusing them as unknown keys.
OFFLINE_ONLY_FIELDS = frozenset({"extra_args", "skip_clone", "detokenize", "flat_logprobs",
                                 "logits_processors", "structured_outputs"})

# Why the engine cannot honour anything but the default of these vLLM fields.
NOT_HONOURED = {
    "detokenize": (True, "only True is supported: the engine always detokenizes (output text, "
                         "stop strings, logprobs' decoded tokens)"),
    "flat_logprobs": (False, "only False is supported: logprobs come as vLLM's list of "
                             "{token_id: Logprob} per position"),
    "logits_processors": (None, "per-request logits processors are not supported (vLLM v1 "
                                "refuses them too); use logit_bias, allowed_token_ids or "
                                "bad_words"),
    "structured_outputs": (None, "structured outputs (JSON schema, regex, choice, grammar) are "
                                 "not supported by this engine"),
}


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; the message names the field."""


class RequestOutputKind(IntEnum):
    """What LLMEngine.step() returns for a request (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1       # only what is new this step (the server and LLM use this)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


OUTPUT_KIND_NAMES = {k.name.lower(): k for k in RequestOutputKind}


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
    seed: int | None = None  # -1: None (vLLM)
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # Top logprobs per generated token (the sampled token's always comes too); True: 1;
    # -1: the whole vocabulary (then bounded by EngineConfig.max_logprobs at admission).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Only the slow (pure Python) tokenizers of transformers honour this; fast tokenizers, which
    # are what we load, never put spaces between special tokens (vLLM v1 ignores it there too).
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # every other token gets -inf
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    # The engine's default is DELTA, not vLLM's CUMULATIVE (docs/engine_api.md says why).
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # vLLM's names the offline API takes but that are not wire fields (OFFLINE_ONLY_FIELDS).
    # extra_args: data for sampling plugins; vLLM's own samplers never read it, nor do ours.
    extra_args: dict | None = None
    # skip_clone: vLLM's promise that the object serves one request only, so it need not be
    # copied; the engine copies it anyway (a few fields), so any bool is accepted.
    skip_clone: bool = field(default=False, repr=False)
    # Accepted at their default only: the engine cannot do anything else (validate() says why).
    detokenize: bool = field(default=True, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    logits_processors: list | None = field(default=None, repr=False)
    structured_outputs: object | None = field(default=None, repr=False)
    # Token ids of each bad word (with and without a leading space), set by the engine at
    # admission from the tokenizer (vLLM's update_from_tokenizer); not a wire field.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        # vLLM dedups both (order kept); unhashable members are left for validate() to name.
        self.stop_token_ids = _dedup(self.stop_token_ids)
        self.bad_words = _dedup(self.bad_words)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logits_processors, (list, tuple)) and not self.logits_processors:
            self.logits_processors = None  # vLLM refuses only a non-empty list
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM: logprobs=True means 1
                setattr(self, name, 1)
        if isinstance(self.output_kind, str) and self.output_kind.lower() in OUTPUT_KIND_NAMES:
            self.output_kind = OUTPUT_KIND_NAMES[self.output_kind.lower()]
        elif (isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool)
              and self.output_kind in {k.value for k in RequestOutputKind}):
            self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _int_keyed(self.logit_bias)
        is_num = isinstance(self.temperature, (int, float)) and not isinstance(
            self.temperature, bool)
        if is_num and 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = MIN_SAMPLING_TEMPERATURE  # vLLM raises it the same way
        self.validate()
        if self.greedy:  # vLLM: greedy ignores the filters
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def validate(self) -> None:
        """vLLM's SamplingParams._verify_args (and _verify_greedy_sampling); the message
        starts with the field's name."""
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{name}: {what}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v))

        def int_list(v) -> bool:
            return isinstance(v, list) and all(is_int(t) for t in v)

        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        need(is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
             "temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}]")
        need(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k",
             "must be 0 (disable), -1 (disable) or at least 1")
        need(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(is_num(self.repetition_penalty)
             and self.repetition_penalty >= MIN_REPETITION_PENALTY, "repetition_penalty",
             f"must be a finite number >= {MIN_REPETITION_PENALTY}")
        need(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty", "must be in [-2, 2]")
        need(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty", "must be in [-2, 2]")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64), "seed",
             "must be None, -1 (none) or an integer in [0, 2**64)")
        need(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens", "must be None or an integer >= 1")
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
             "must be an integer >= 0")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be less than or equal to max_tokens={self.max_tokens}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop),
             "stop", "must be a string or a list of strings")
        need(all(self.stop), "stop", "cannot contain an empty string")
        need(int_list(self.stop_token_ids), "stop_token_ids", "must contain only integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= -1), name, "must be non-negative or -1")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "must be a boolean")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            is_int(k) and is_num(v) for k, v in self.logit_bias.items())), "logit_bias",
             "must map integer token ids to finite numbers")
        need(self.allowed_token_ids is None or int_list(self.allowed_token_ids),
             "allowed_token_ids", "must be None or a list of integer token ids")
        need(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids", "is not None and empty!")
        need(isinstance(self.bad_words, list) and all(
            isinstance(w, str) and w for w in self.bad_words), "bad_words",
             "must be a list of non-empty strings")
        need(self.truncate_prompt_tokens is None or (
            is_int(self.truncate_prompt_tokens)
            and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
             "truncate_prompt_tokens", "must be an integer >= 1 or -1")
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind",
             "must be a RequestOutputKind (0 cumulative, 1 delta, 2 final_only)")
        need(self.extra_args is None or (isinstance(self.extra_args, dict) and all(
            isinstance(k, str) for k in self.extra_args)), "extra_args",
             "must be None or a dict with string keys")
        need(isinstance(self.skip_clone, bool), "skip_clone", "must be a boolean")
        for name, (default, why) in NOT_HONOURED.items():
            need(getattr(self, name) is default, name, why)  # True, False, None: singletons
        if self.greedy:
            need(self.n == 1, "n", "must be 1 when using greedy sampling")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's SamplingParams.clone)."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict:
        """The wire fields (no engine-private or offline-only ones); output_kind as its int
        value."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if not f.name.startswith("_") and f.name not in OFFLINE_ONLY_FIELDS}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["bad_words"] = list(self.bad_words)
        out["output_kind"] = int(self.output_kind)
        if self.logit_bias is not None:
            out["logit_bias"] = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            out["allowed_token_ids"] = list(self.allowed_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Build from a wire/JSON dict; unknown keys are an error that names them. logit_bias
        keys may be strings of integers (JSON objects have only string keys)."""
        known = {f.name for f in dataclasses.fields(cls)
                 if not f.name.startswith("_") and f.name not in OFFLINE_ONLY_FIELDS}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**data)


def _dedup(values):
    """A list or tuple without repeats, first occurrence kept; anything else unchanged."""
    if not isinstance(values, (list, tuple)):
        return values
    try:
        return list(dict.fromkeys(values))
    except TypeError:  # an unhashable member: validate() refuses it with the field's name
        return list(values)


_TOKEN_ID_TEXT = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")


def token_id_key(key) -> int | None:
    """A logit_bias key as a token id: an int (not a bool), or its canonical ASCII decimal
    text ("123"; JSON keys are strings). None for anything else: int() would also take
    "١٢", " 012 " and "1_0", and let "12" and "012" name one token twice."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and _TOKEN_ID_TEXT.fullmatch(key):
        return int(key)
    return None


def _int_keyed(bias: dict) -> dict:
    """logit_bias with int keys: "123" -> 123 (JSON); vLLM's message for keys that are not
    token ids, or that name a token another key names too (12 and "12")."""
    out, bad = {}, []
    for key, value in bias.items():
        token_id = token_id_key(key)
        if token_id is None or token_id in out:
            bad.append(key)
        else:
            out[token_id] = value
    if bad:
        raise SamplingParamsError(f"logit_bias: contains key(s) that cannot be converted to "
                                  f"integer token IDs: {bad[:8]!r}")
    return out
