"""OpenAI's error body and the HTTP status of every failure the gateway reports.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` (the shape the OpenAI SDK
parses into its `APIStatusError` subclasses by status). `code` carries the engine's ZeroMQ error
code when the engine refused the request (`prompt_too_long`, `overloaded`, ...), so a client sees
the precise reason; `param` names the request field when the message names one.
"""
from __future__ import annotations

import re

# ZeroMQ ERROR codes (docs/protocol.md, "ERROR") -> HTTP status. Bad input is the client's (400),
# `overloaded` asks it to retry later (429), a draining or unreachable engine is 503.
ENGINE_CODE_STATUS = {
    "invalid_request": 400,
    "invalid_message": 400,
    "message_too_large": 400,
    "empty_prompt": 400,
    "prompt_too_long": 400,
    "capacity": 400,  # prompt + max_tokens can never fit the KV cache: ask for less
    "duplicate_request_id": 400,
    "overloaded": 429,
    "shutting_down": 503,
    "server_unavailable": 503,
    "unsupported_version": 502,  # the engine speaks another protocol version: a bad upstream
    "unknown_type": 502,
    "lease_expired": 500,
    "internal_error": 500,
}
GATEWAY_TIMEOUT = 504  # the engine sent nothing for the request within the client's timeout

# The `type` of an OpenAI error body, by status (the SDK keys on the status; people read this).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "overloaded_error",
    500: "internal_server_error",
    501: "not_implemented_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# Seconds a client told 429 or 503 should wait before retrying (the Retry-After header).
RETRY_AFTER_S = 1

# The engine's messages name the field first ("temperature: must be ...", "messages[2].role:
# ..."); that prefix becomes `param`.
_PARAM_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*)*):")


WIRE_SAMPLING_PREFIX = "sampling_params."


class ApiError(Exception):
    """A failure answered with an OpenAI error body; raised anywhere before a response starts."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(RETRY_AFTER_S)} if self.status in (429, 503) else {}


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request")


def param_of(message: str) -> str | None:
    """The field a message starts with ("top_p: must be in (0, 1]" -> "top_p"), else None."""
    m = _PARAM_PREFIX.match(message)
    if m is None:
        return None
    name = m.group(1)
    # The ZeroMQ server names sampling fields by their place in GENERATE; OpenAI's are flat.
    return name[len(WIRE_SAMPLING_PREFIX):] if name.startswith(WIRE_SAMPLING_PREFIX) else name


def from_engine_error(exc: Exception) -> ApiError:
    """An exception of the ZeroMQ client (`ServerError` with the wire `code`, or
    `RequestTimeout`) as the ApiError to answer with."""
    code = getattr(exc, "code", None)
    if code is None:  # RequestTimeout (a TimeoutError): the engine did not answer in time
        return ApiError(GATEWAY_TIMEOUT, f"the engine did not answer in time: {exc}",
                        code="timeout")
    message = getattr(exc, "message", None) or str(exc)
    if message.startswith(WIRE_SAMPLING_PREFIX):  # OpenAI's request has these fields at the top
        message = message[len(WIRE_SAMPLING_PREFIX):]
    status = ENGINE_CODE_STATUS.get(code, 500)
    return ApiError(status, message, param=param_of(message) if status == 400 else None,
                    code=code)
