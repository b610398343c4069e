"""OpenAI request bodies -> what the GENERATEs of one HTTP request need (`GenerationSpec`).

Checked here: the JSON types of every field the gateway reads, the request shapes (messages,
prompts), and OpenAI's rules between fields (`top_logprobs` needs `logprobs`, `stream_options`
needs `stream`). Value ranges are the engine's (`SamplingParams.validate` behind the ZeroMQ
server): its `invalid_request` comes back as a 400 naming the field, with the same message every
entry point gives. OpenAI names map onto vLLM's `SamplingParams` names; vLLM's extra fields
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, ...) pass through, and a
field is sent only when the request sets it, so an engine server of an older protocol revision
sees no field it does not know unless the client asked for it.

Fields OpenAI defines that we cannot honour (`suffix`, `best_of` != n, `response_format` other
than text, forced tool calls, structured-output fields) are a 400; unknown fields are ignored,
as vLLM's OpenAI server does (logged at debug level).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from pagedrun.runtime.sampling_params import token_id_key
from pagedrun.server.http.errors import bad_request

log = logging.getLogger("pagedrun.http")

# The protocol's chat roles (docs/protocol.md, GENERATE `messages`); OpenAI's newer `developer`
# role is the system prompt of older models, so it becomes `system`.
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}
# Text parts of one message are joined with a newline (vLLM does the same).
CONTENT_PART_JOINER = "\n"
# A completions request may carry a batch of prompts; each becomes its own GENERATE, all in
# flight at once. Bounded so one HTTP request cannot fill the engine's whole queue by itself.
MAX_BATCH_PROMPTS = 256
# OpenAI's documented defaults: completions generate 16 tokens unless told; chat has no default
# cap (up to the context: the engine's max_tokens None).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's logit_bias range; vLLM's OpenAI layer clamps to it rather than refusing.
MAX_ABS_LOGIT_BIAS = 100.0

UNSUPPORTED = ("suffix", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "audio")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


# Sampling fields that pass through under the same name: (name, check, what it must be).
PASS_THROUGH = (
    ("temperature", _is_num, "a number"),
    ("top_p", _is_num, "a number"),
    ("n", _is_int, "an integer"),
    ("seed", _is_int, "an integer"),
    ("presence_penalty", _is_num, "a number"),
    ("frequency_penalty", _is_num, "a number"),
    # vLLM's extra fields.
    ("top_k", _is_int, "an integer"),
    ("min_p", _is_num, "a number"),
    ("repetition_penalty", _is_num, "a number"),
    ("min_tokens", _is_int, "an integer"),
    ("ignore_eos", _is_bool, "a boolean"),
    ("stop_token_ids", _is_int_list, "a list of integers"),
    ("include_stop_str_in_output", _is_bool, "a boolean"),
    ("skip_special_tokens", _is_bool, "a boolean"),
    ("spaces_between_special_tokens", _is_bool, "a boolean"),
    ("allowed_token_ids", _is_int_list, "a list of integers"),
    ("bad_words", _is_str_list, "a list of strings"),
    ("truncate_prompt_tokens", _is_int, "an integer"),
    ("prompt_logprobs", _is_int, "an integer"),
)
# Chat-template options (protocol 1.3 GENERATE fields, with `messages` only).
CHAT_OPTIONS = (
    ("chat_template", lambda v: isinstance(v, str), "a string"),
    ("add_generation_prompt", _is_bool, "a boolean"),
    ("continue_final_message", _is_bool, "a boolean"),
    ("tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
     "a list of objects"),
    ("chat_template_kwargs", lambda v: isinstance(v, dict), "an object"),
)


@dataclass
class PromptInput:
    """One GENERATE's prompt: exactly one of the three is set."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None


@dataclass
class GenerationSpec:
    """What one chat or completions request asks of the engine, and how to answer it."""

    kind: str                      # "chat" or "completion"
    model: str | None
    prompts: list[PromptInput]
    sampling_params: dict          # the wire's sampling_params (vLLM names), only fields set
    chat_options: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False    # stream_options.include_usage
    n: int = 1
    echo: bool = False             # completions: the prompt text before each choice's text
    logprobs: int | None = None    # top alternatives per generated token; None: not asked
    prompt_logprobs: int | None = None  # vLLM's extra field, answered as `prompt_logprobs`
    user: str | None = None


def field_value(body: dict, name: str, check, what: str):
    """body[name] when present and not null, after its type check; None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not check(value):
        raise bad_request(f"{name}: must be {what}, got {type(value).__name__}", name)
    return value


def _common(body: dict, spec: GenerationSpec) -> None:
    """The fields chat and completions share: sampling, stop, logit_bias, stream, model, user."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request(f"{name}: not supported by this server", name)
    spec.model = field_value(body, "model", lambda v: isinstance(v, str), "a string")
    spec.user = field_value(body, "user", lambda v: isinstance(v, str), "a string")
    params = spec.sampling_params
    for name, check, what in PASS_THROUGH:
        value = field_value(body, name, check, what)
        if value is not None:
            params[name] = value
    spec.n = params.get("n", 1)
    best_of = field_value(body, "best_of", _is_int, "an integer")
    if best_of is not None and best_of != spec.n:
        raise bad_request("best_of: only best_of == n is supported", "best_of")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not _is_str_list(stop):
            raise bad_request("stop: must be a string or a list of strings", "stop")
        params["stop"] = stop
    bias = field_value(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
    if bias is not None:
        params["logit_bias"] = _logit_bias(bias)
    spec.stream = bool(field_value(body, "stream", _is_bool, "a boolean"))
    options = field_value(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is not None:
        if not spec.stream:
            raise bad_request("stream_options: only allowed with stream: true", "stream_options")
        spec.include_usage = bool(field_value(options, "include_usage", _is_bool, "a boolean"))
        if field_value(options, "continuous_usage_stats", _is_bool, "a boolean"):
            raise bad_request("stream_options.continuous_usage_stats: not supported",
                              "stream_options")
    spec.prompt_logprobs = params.get("prompt_logprobs")


def _logit_bias(bias: dict) -> dict:
    """OpenAI's {"token id": bias} with string keys -> the wire's map, values clamped to
    [-100, 100] (vLLM's OpenAI layer clamps too; the wire refuses larger values). The keys stay
    strings: protocol maps have string keys (docs/protocol.md, "Frames")."""
    out = {}
    for key, value in bias.items():
        token_id = token_id_key(key)
        if token_id is None:
            raise bad_request(f"logit_bias: key {key!r} is not a token id (decimal digits)",
                              "logit_bias")
        if str(token_id) in out:
            raise bad_request(f"logit_bias: token {token_id} is named twice", "logit_bias")
        if not _is_num(value):
            raise bad_request(f"logit_bias: value of {key!r} must be a number", "logit_bias")
        out[str(token_id)] = max(-MAX_ABS_LOGIT_BIAS, min(MAX_ABS_LOGIT_BIAS, float(value)))
    return out


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    """The first of `names` that is set (max_completion_tokens wins over max_tokens)."""
    for name in names:
        value = field_value(body, name, _is_int, "an integer")
        if value is not None:
            return value
    return default


def _content(value, where: str) -> str:
    """A message's content as one string: a string, null (an assistant turn that only called
    tools), or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}]: only text parts are supported "
                                  "({\"type\": \"text\", \"text\": ...})", "messages")
            texts.append(part["text"])
        return CONTENT_PART_JOINER.join(texts)
    raise bad_request(f"{where}.content: must be a string or a list of text parts", "messages")


def parse_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages: must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: must be an object", "messages")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(CHAT_ROLES)} or "
                              "developer", "messages")
        out.append({"role": role, "content": _content(m.get("content"), where)})
    return out


def parse_chat(body: dict) -> GenerationSpec:
    """A POST /v1/chat/completions body."""
    spec = GenerationSpec(kind="chat", model=None, prompts=[], sampling_params={})
    _common(body, spec)
    spec.prompts = [PromptInput(messages=parse_messages(body.get("messages")))]
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    spec.sampling_params["max_tokens"] = max_tokens
    want = field_value(body, "logprobs", _is_bool, "a boolean")
    top = field_value(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not want:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    if want:
        spec.logprobs = top or 0
        spec.sampling_params["logprobs"] = spec.logprobs
    fmt = field_value(body, "response_format", lambda v: isinstance(v, dict), "an object")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise bad_request("response_format: only {\"type\": \"text\"} is supported",
                          "response_format")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("tool_choice: only \"none\" and \"auto\" are supported (tools are "
                          "passed to the chat template; calls are not parsed)", "tool_choice")
    for name, check, what in CHAT_OPTIONS:
        value = field_value(body, name, check, what)
        if value is not None:
            spec.chat_options[name] = value
    return spec


def _prompts(value) -> list[PromptInput]:
    """OpenAI's completions prompt: a string, a list of strings, a list of token ids, or a list
    of token-id lists."""
    if isinstance(value, str):
        return [PromptInput(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            prompts = [PromptInput(text=p) for p in value]
        elif _is_int_list(value):
            prompts = [PromptInput(token_ids=list(value))]
        elif all(_is_int_list(p) for p in value):
            prompts = [PromptInput(token_ids=list(p)) for p in value]
        else:
            prompts = []
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request",
                              "prompt")
        if prompts:
            return prompts
    raise bad_request("prompt: must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists (non-empty)", "prompt")


def parse_completion(body: dict) -> GenerationSpec:
    """A POST /v1/completions body."""
    spec = GenerationSpec(kind="completion", model=None, prompts=[], sampling_params={})
    _common(body, spec)
    spec.prompts = _prompts(body.get("prompt"))
    spec.sampling_params["max_tokens"] = _max_tokens(body, ("max_tokens",),
                                                     COMPLETIONS_DEFAULT_MAX_TOKENS)
    spec.echo = bool(field_value(body, "echo", _is_bool, "a boolean"))
    k = field_value(body, "logprobs", _is_int, "an integer")
    if k is not None:
        spec.logprobs = k
        spec.sampling_params["logprobs"] = k
        if spec.echo and "prompt_logprobs" not in spec.sampling_params:
            # The echoed prompt's tokens get logprobs too (OpenAI's echo + logprobs).
            spec.sampling_params["prompt_logprobs"] = k
    return spec
