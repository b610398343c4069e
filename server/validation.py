"""Field validation of client messages: every field's type and range, unknown fields, prompts.

Turns a decoded body into a typed request or raises ProtocolError naming the field, so a bad
message is answered with an error and never reaches the engine. Limits that depend on the model
(vocab size, max_model_len) come from `ModelLimits`.

Total: whatever a decoded body holds (protocol.decode has already bounded its nesting and made
every map key a string), the outcome is a request or a ProtocolError; an error message quotes a
client's value only through `safe_repr` (short, never raises). Beyond SamplingParams' own
ranges the server enforces the limits of docs/protocol.md ("sampling_params"): token ids in
the vocabulary, bounded stop lists, and no repetition_penalty small enough to overflow the
logits (those are requests the engine cannot serve safely).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedrun.runtime.sampling_params import SamplingParams, SamplingParamsError
from pagedrun.server.protocol import (CHAT_ROLES, MAX_CHAT_MESSAGES, MAX_REQUEST_ID_CHARS,
                                      MAX_ROLE_CHARS, ErrorCode, MsgType, ProtocolError, is_int,
                                      safe_repr)

# Server limits on sampling_params beyond SamplingParams.validate (docs/protocol.md, 1.2).
# Stop conditions are checked for every generated token in the engine thread: bounded lists
# keep that check cheap whatever a client sends.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


@dataclass
class GenerateRequest:
    request_id: str
    sampling_params: SamplingParams
    stream: bool = True
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None


# Allowed fields per message type; anything else is an error that names it.
FIELDS = {
    MsgType.GENERATE: {"request_id", "prompt", "prompt_token_ids", "messages",
                       "sampling_params", "stream"},
    MsgType.ABORT: {"request_id"},
    MsgType.PING: {"request_id"},
    MsgType.MODEL_INFO: {"request_id"},
    MsgType.STATS: {"request_id"},
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
        check_prompt_len(len(ids), limits, rid)
        req.prompt_token_ids = ids
    else:
        req.messages = _check_messages(body["messages"], rid)
    return req


def parse_sampling_params(raw, limits: ModelLimits, rid: str | None) -> SamplingParams:
    """SamplingParams.from_dict plus the server's limits; any failure is invalid_request."""
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        _bad("sampling_params: must be a map with string keys", rid)
    try:
        params = SamplingParams.from_dict(raw)
    except SamplingParamsError as exc:
        _bad(f"sampling_params.{_exception_text(exc)}", rid)
    except Exception as exc:  # noqa: BLE001 -- e.g. TypeError: stop given as a number
        _bad(f"sampling_params: {_exception_text(exc)}", rid)
    stop_ids = params.stop_token_ids
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        _bad(f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, "
             f"got {len(stop_ids)}", rid)
    for t in stop_ids:
        if not 0 <= t < limits.vocab_size:  # validate() made each an int >= 0
            _bad(f"sampling_params.stop_token_ids: every id must be an integer in "
                 f"[0, {limits.vocab_size}), got {safe_repr(t)}", rid)
    if len(params.stop) > MAX_STOP_STRINGS:
        _bad(f"sampling_params.stop: at most {MAX_STOP_STRINGS} strings, "
             f"got {len(params.stop)}", rid)
    if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        _bad(f"sampling_params.stop: each string at most {MAX_STOP_STRING_CHARS} characters",
             rid)
    return params


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
