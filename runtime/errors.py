"""Exception types that cross module boundaries in the runtime.

Every error a user can cause by pointing paged-run at a bad model directory is a
`ModelLoadError` whose message names the file (and, where one is involved, the tensor or the
config field), so that no numpy or json traceback ever reaches the user. Other modules add their
own error classes here, all deriving from `PagedRunError`.
"""
from __future__ import annotations

import os


class PagedRunError(Exception):
    """Base class of every error paged-run raises on purpose."""


class ModelLoadError(PagedRunError):
    """A model directory, config file or weight file cannot be used.

    The message always starts with the offending file; `path`, `tensor` and `field` keep the
    parts for callers that want them (tests, the CLI's error printer).
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        message: str,
        *,
        tensor: str | None = None,
        field: str | None = None,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        self.field = field
        parts = []
        if self.path is not None:
            parts.append(self.path)
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if field is not None:
            parts.append(f"field {field!r}")
        parts.append(message)
        super().__init__(": ".join(parts))


# Error codes of RequestError (docs/engine_api.md); the server's protocol maps each to its own
# ErrorCode of the same name (server/protocol.py).
ERR_INVALID = "invalid_request"
ERR_TOO_LONG = "prompt_too_long"
ERR_EMPTY = "empty_prompt"
ERR_DUPLICATE = "duplicate_request_id"
ERR_CAPACITY = "capacity"


class RequestError(PagedRunError):
    """A request was refused at admission; nothing of it was admitted."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DeviceNotAvailableError(PagedRunError, NotImplementedError):
    """The asked-for device's backend does not exist (yet) or sees no device."""


# Longest exception text carried into RequestOutput.error (and so onto the wire).
MAX_ERROR_CHARS = 500


def describe_fault(where: str, exc: BaseException) -> str:
    """A short, safe message for RequestOutput.error: where it happened and the exception."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 -- an exception whose str() raises
        text = type(exc).__name__
    return f"{where} failed: {text}"[:MAX_ERROR_CHARS]
