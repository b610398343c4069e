"""The optional API key: `--api-key KEY` makes every /v1/ route ask for
`Authorization: Bearer KEY` (vLLM protects the same routes; /health, /version, /metrics,
/tokenize and /detokenize stay open, as there). A wrong or missing key is a 401 in OpenAI's error
shape. Compared in constant time.
"""
from __future__ import annotations

import hmac
import json

from pagedrun.server.http.errors import error_body

PROTECTED_PREFIX = "/v1/"


class BearerAuth:
    """ASGI middleware: checks the Bearer key on PROTECTED_PREFIX paths."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps(error_body(401, "Unauthorized: a valid API key is required "
                                             "(Authorization: Bearer KEY)",
                                             code="invalid_api_key")).encode("utf-8")
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
