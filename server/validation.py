"""Field validation of client messages: every field's type and range, unknown fields, prompts.

Turns a decoded body into a typed request or raises ProtocolError naming the field, so a bad
message is answered with an error and never reaches the engine. Limits that depend on the model
(vocab size, max_model_len) come from `ModelLimits`.

Total: whatever a decoded body holds (protocol.decode has already bounded its nesting and made
every map key a string), the outcome is a request or a ProtocolError; an error message quotes a
client's value only through `safe_repr` (short, never raises). Beyond SamplingParams' own
ranges (vLLM's) the server enforces the limits of docs/protocol.md ("sampling_params"): the
checks vLLM makes against the model (token ids in the vocabulary, logprobs up to the engine's
`max_logprobs`; the same messages as the engine's admission), bounded lists (stop strings and
ids, bad words, logit_bias, allowed_token_ids: the engine thread walks them), and logit_bias
values a float32 logit survives. `output_kind` is no wire field: the server always asks the
engine for DELTA outputs and streams them per GENERATE's `stream` (protocol 1.3).

Chat options (1.3: chat_template, add_generation_prompt, continue_final_message, tools,
chat_template_kwargs) go with `messages` only and become a runtime ChatOptions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pagedrun.runtime.chat_options import ChatOptions, ChatOptionsError
from pagedrun.runtime.sampling_params import (MAX_LOGPROBS, RequestOutputKind, SamplingParams,
                                              SamplingParamsError)
from pagedrun.server.protocol import (CHAT_ROLES, MAX_CHAT_MESSAGES, MAX_LORA_NAME_CHARS,
                                      MAX_LORA_PATH_CHARS, MAX_REQUEST_ID_CHARS,
                                      MAX_ROLE_CHARS, ErrorCode, MsgType, ProtocolError, is_int,
                                      safe_repr)

# Server limits on sampling_params beyond SamplingParams.validate (docs/protocol.md, 1.2).
# Stop conditions are checked for every generated token in the engine thread: bounded lists
# keep that check cheap whatever a client sends.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# 1.3. Bad words are tokenized at admission (twice each) and matched against the output tail
# every step; logit_bias and allowed_token_ids become per-request masks. A real use (a banned
# phrase list, a bias on a few hundred tokens, a choice among labels) fits well inside these.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 16384
# A bias beyond +-100 decides the sample alone already (the OpenAI API's range; vLLM's OpenAI
# front end clamps to it); larger finite values only push float32 logits towards inf, where two
# biased tokens make the softmax NaN.
MAX_ABS_LOGIT_BIAS = 100.0
# Chat options (1.3): their size limits are ChatOptions' (runtime/chat_options.py), the same on
# every path.
CHAT_OPTION_FIELDS = ("chat_template", "add_generation_prompt", "continue_final_message",
                      "tools", "chat_template_kwargs")
# Parameters of Tokenizer.apply_chat_template itself, so never template variables (ChatOptions
# refuses the names that are chat options; these would collide with the call).
NOT_TEMPLATE_VARIABLES = frozenset({"tokenize", "chat_template"})


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    # The engine's EngineConfig.max_logprobs (vLLM's max_logprobs; -1: the whole vocabulary).
    max_logprobs: int = MAX_LOGPROBS


@dataclass
class GenerateRequest:
    request_id: str
    sampling_params: SamplingParams
    stream: bool = True
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    chat_options: ChatOptions | None = None  # only with messages, only when any was sent
    lora_name: str | None = None  # (1.4) the adapter to run under; None: the base model


# Allowed fields per message type; anything else is an error that names it.
FIELDS = {
    MsgType.GENERATE: {"request_id", "prompt", "prompt_token_ids", "messages",
                       "sampling_params", "stream", "lora_name", *CHAT_OPTION_FIELDS},
    MsgType.ABORT: {"request_id"},
    MsgType.PING: {"request_id"},
    MsgType.MODEL_INFO: {"request_id"},
    MsgType.STATS: {"request_id"},
    MsgType.LOAD_LORA: {"request_id", "lora_name", "lora_path"},
    MsgType.UNLOAD_LORA: {"request_id", "lora_name"},
}
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


def _bad(message: str, rid: str | None, code: ErrorCode = ErrorCode.INVALID_REQUEST):
    raise ProtocolError(code, message, rid)


def check_request_id(value, required: bool) -> str | None:
    if value is None:
        if required:
            _bad("request_id: required (a string of 1 to "
                 f"{MAX_REQUEST_ID_CHARS} characters)", None)
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        _bad(f"request_id: must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters", None)
    return value


def check_fields(msg_type: MsgType, body: dict) -> str | None:
    """Common checks: unknown fields and the request id. Returns the request id (or None)."""
    rid = check_request_id(body.get("request_id"), required=msg_type in (MsgType.GENERATE,
                                                                         MsgType.ABORT))
    unknown = sorted(str(k) for k in set(body) - FIELDS[msg_type])
    if unknown:
        _bad(f"unknown field(s) for {msg_type.name}: "
             f"{', '.join(safe_repr(k) for k in unknown[:8])}"
             f"{' ...' if len(unknown) > 8 else ''}", rid)
    return rid


def _check_messages(value, rid: str) -> list[dict]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CHAT_MESSAGES:
        _bad(f"messages: must be a list of 1 to {MAX_CHAT_MESSAGES} maps", rid)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            _bad(f"messages[{i}]: must be a map with exactly 'role' and 'content'", rid)
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in CHAT_ROLES or len(role) > MAX_ROLE_CHARS:
            _bad(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}", rid)
        if not isinstance(content, str):
            _bad(f"messages[{i}].content: must be a string", rid)
        out.append({"role": role, "content": content})
    if not any(m["content"] for m in out):
        _bad("messages: every content is empty", rid, ErrorCode.EMPTY_PROMPT)
    return out


def parse_generate(body: dict, limits: ModelLimits) -> GenerateRequest:
    rid = check_fields(MsgType.GENERATE, body)
    given = [f for f in PROMPT_FIELDS if f in body]
    if len(given) != 1:
        _bad("exactly one of prompt, prompt_token_ids, messages is required"
             f" (got {', '.join(given) or 'none'})", rid)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        _bad("stream: must be a boolean", rid)
    params = parse_sampling_params(body.get("sampling_params", {}), limits, rid)
    req = GenerateRequest(request_id=rid, sampling_params=params, stream=stream)
    if body.get("lora_name") is not None:
        req.lora_name = _check_text("lora_name", body["lora_name"], MAX_LORA_NAME_CHARS, rid)
    options = [f for f in CHAT_OPTION_FIELDS if f in body]
    if options and "messages" not in body:
        _bad(f"{', '.join(options)}: chat options go with messages only (this request has "
             f"{given[0]})", rid)
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            _bad("prompt: must be a string", rid)
        if not prompt:
            _bad("prompt: is empty", rid, ErrorCode.EMPTY_PROMPT)
        req.prompt = prompt
    elif "prompt_token_ids" in body:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list):
            _bad("prompt_token_ids: must be a list of integers", rid)
        if not ids:
            _bad("prompt_token_ids: is empty", rid, ErrorCode.EMPTY_PROMPT)
        if not all(is_int(t) and 0 <= t < limits.vocab_size for t in ids):
            _bad(f"prompt_token_ids: every id must be an integer in [0, {limits.vocab_size})", rid)
        ids = truncate_prompt(ids, params, limits)
        check_prompt_len(len(ids), limits, rid)
        req.prompt_token_ids = ids
    else:
        req.messages = _check_messages(body["messages"], rid)
        if options:
            req.chat_options = parse_chat_options({f: body[f] for f in options}, rid)
    return req


def _check_text(field: str, value, max_chars: int, rid: str | None) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= max_chars:
        _bad(f"{field}: must be a string of 1 to {max_chars} characters", rid)
    return value


def parse_lora_message(msg_type: MsgType, body: dict) -> tuple[str | None, str, str | None]:
    """(request_id, lora_name, lora_path) of a LOAD_LORA (path required) or UNLOAD_LORA."""
    rid = check_fields(msg_type, body)
    name = _check_text("lora_name", body.get("lora_name"), MAX_LORA_NAME_CHARS, rid)
    path = None
    if msg_type == MsgType.LOAD_LORA:
        path = _check_text("lora_path", body.get("lora_path"), MAX_LORA_PATH_CHARS, rid)
    return rid, name, path


def parse_chat_options(raw: dict, rid: str) -> ChatOptions:
    """The chat option fields of a GENERATE (1.3) as a ChatOptions; types, sizes and
    combinations checked by ChatOptions itself (its messages name the field)."""
    kwargs = raw.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and NOT_TEMPLATE_VARIABLES & set(kwargs):
        _bad(f"chat_template_kwargs: {', '.join(sorted(NOT_TEMPLATE_VARIABLES & set(kwargs)))} "
             "cannot be template variables", rid)
    try:
        return ChatOptions(**raw)
    except ChatOptionsError as exc:
        _bad(_exception_text(exc), rid)
    except Exception as exc:  # noqa: BLE001 -- a value no check foresaw: still the client's
        _bad(f"chat options: {_exception_text(exc)}", rid)


# Raw list/map sizes bounded before SamplingParams touches them (it deduplicates lists).
_RAW_SIZE_LIMITS = (("stop", MAX_STOP_STRINGS, "strings"),
                    ("stop_token_ids", MAX_STOP_TOKEN_IDS, "ids"),
                    ("bad_words", MAX_BAD_WORDS, "words"),
                    ("logit_bias", MAX_LOGIT_BIAS_ENTRIES, "entries"),
                    ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "ids"))
# Lists SamplingParams deduplicates (a set of their elements) before it checks their types:
# an element that is itself a list or a map would fail there without naming the field.
_DEDUPLICATED = (("stop", "strings"), ("stop_token_ids", "integers"), ("bad_words", "strings"))


def parse_sampling_params(raw, limits: ModelLimits, rid: str | None) -> SamplingParams:
    """SamplingParams.from_dict plus the server's limits; any failure is invalid_request."""
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        _bad("sampling_params: must be a map with string keys", rid)
    if "output_kind" in raw:
        _bad("sampling_params.output_kind: not a wire field; use GENERATE's `stream` (true: a "
             "DELTA per step, false: one FINAL holding everything)", rid)
    for name, limit, what in _RAW_SIZE_LIMITS:
        value = raw.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            _bad(f"sampling_params.{name}: at most {limit} {what}, got {len(value)}", rid)
    for name, what in _DEDUPLICATED:
        value = raw.get(name)
        if isinstance(value, list) and any(isinstance(v, (list, dict)) for v in value):
            _bad(f"sampling_params.{name}: must be a list of {what}", rid)
    try:
        params = SamplingParams.from_dict(raw)
    except SamplingParamsError as exc:
        _bad(f"sampling_params.{_exception_text(exc)}", rid)
    except Exception as exc:  # noqa: BLE001 -- e.g. TypeError: stop given as a number
        _bad(f"sampling_params: {_exception_text(exc)}", rid)
    # The server consumes per-step deltas whatever the client wants to see (`stream`).
    params.output_kind = RequestOutputKind.DELTA
    if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        _bad(f"sampling_params.stop: each string at most {MAX_STOP_STRING_CHARS} characters",
             rid)
    if any(len(w) > MAX_BAD_WORD_CHARS for w in params.bad_words):
        _bad(f"sampling_params.bad_words: each word at most {MAX_BAD_WORD_CHARS} characters",
             rid)
    if params.logit_bias is not None and any(
            not (math.isfinite(v) and abs(v) <= MAX_ABS_LOGIT_BIAS)
            for v in params.logit_bias.values()):
        _bad(f"sampling_params.logit_bias: every bias must lie in [-{MAX_ABS_LOGIT_BIAS:g}, "
             f"{MAX_ABS_LOGIT_BIAS:g}]", rid)
    message = model_check_message(params, limits)
    if message is not None:
        _bad(message, rid)
    return params


def model_check_message(params: SamplingParams, limits: ModelLimits) -> str | None:
    """vLLM's checks of SamplingParams against the model (vllm/sampling_params.py
    SamplingParams.verify and its helpers; truncate_prompt_tokens against max_model_len), with
    vLLM's messages -- the same text the engine's admission gives (docs/protocol.md quotes
    them); None when the request passes."""
    vocab = limits.vocab_size
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        num = getattr(params, name)
        if num is None:
            continue
        num = vocab if num == -1 else num
        most = vocab if limits.max_logprobs == -1 else limits.max_logprobs
        if num > most:
            return (f"Requested {what} logprobs of {num}, which is greater than max allowed: "
                    f"{most}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        return (f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab}")
    if params.logit_bias is not None:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if bad:
            return (f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}")
    if params.allowed_token_ids is not None and not all(
            0 <= t < vocab for t in params.allowed_token_ids):
        return "allowed_token_ids contains out-of-vocab token id!"
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > limits.max_model_len:  # the engine's rule (and vLLM's)
        return (f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({limits.max_model_len})")
    return None


def truncate_prompt(ids: list[int], params: SamplingParams, limits: ModelLimits) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = limits.max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def _exception_text(exc: BaseException) -> str:
    """str(exc), or its type's name when str() itself fails; cut by error_body anyway."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001
        return type(exc).__name__


def check_prompt_len(num_prompt_tokens: int, limits: ModelLimits, rid: str) -> None:
    # Same rule as the engine's admission: the last sampled token's KV is never written, so a
    # prompt of exactly max_model_len tokens still gets one generated token.
    if num_prompt_tokens > limits.max_model_len:
        _bad(f"prompt has {num_prompt_tokens} tokens, more than max_model_len "
             f"{limits.max_model_len}", rid, ErrorCode.PROMPT_TOO_LONG)
