"""Pieces both response formats share: response ids, the `usage` block, choice indices.

`usage` follows OpenAI: prompt_tokens, completion_tokens, total_tokens, and
`prompt_tokens_details.cached_tokens` (prompt tokens the engine served from its prefix cache,
the ZeroMQ FINAL's `cached_prompt_tokens`), summed over every GENERATE of the request (a
completions batch sends one per prompt; with n > 1 each GENERATE counts its prompt once and the
completion tokens of all n sequences).
"""
from __future__ import annotations

import time
import uuid


def new_response_id(prefix: str) -> str:
    """`chatcmpl-...` / `cmpl-...`; also the ZeroMQ request id (with a suffix per prompt)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def created_now() -> int:
    return int(time.time())


def usage_body(completions) -> dict:
    """The usage block of a request whose GENERATEs ended with these Completions."""
    prompt = sum(int(c.usage.get("prompt_tokens", 0)) for c in completions)
    generated = sum(int(c.usage.get("completion_tokens", 0)) for c in completions)
    cached = sum(int(c.usage.get("cached_prompt_tokens", 0)) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_index(job: int, index: int, n: int) -> int:
    """OpenAI numbers the choices of a batch of prompts prompt-major: prompt j's i-th sequence
    is choice j * n + i."""
    return job * n + index
