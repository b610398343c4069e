"""The tokenizer work of /tokenize and /detokenize: bounded, and off the gateway's event loop.

Encoding a long prompt or rendering a chat template is CPU work: on the event loop it stalled
every endpoint (a 15.6 MB prompt: 17 s, issue 36). Here it runs on TOKENIZER_THREADS worker
threads of its own (not the loop's default executor, which other work shares), so the loop
goes on serving; a burst of /tokenize requests queues for those threads, which bounds their
CPU. What one request may ask is bounded before any of it runs: its body by the engine's
max_message_bytes (MODEL_INFO; what a GENERATE of the same text may carry, so /tokenize
accepts nothing the engine would refuse to generate from), and its chat options by
ChatOptions' own limits (template size, tools, template variables), as on every other path.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pagedrun.server.http.errors import ApiError
from pagedrun.server.protocol import DEFAULT_MAX_MESSAGE_BYTES

# Two threads: one long request does not hold up a short one behind it, and tokenizer work
# never takes more than two cores from the gateway process.
TOKENIZER_THREADS = 2
_executor = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS,
                               thread_name_prefix="pagedrun-tokenizer")


async def run_tokenizer(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """fn(*args, **kwargs) on a tokenizer thread; the event loop serves others meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(fn, *args, **kwargs))


def check_body_size(body_bytes: int, model_info: dict) -> None:
    """400 message_too_large when a /tokenize or /detokenize body is over the engine's
    max_message_bytes (MODEL_INFO_REPLY's server.max_message_bytes), the limit a GENERATE
    carrying the same text meets."""
    limit = int((model_info.get("server") or {}).get("max_message_bytes")
                or DEFAULT_MAX_MESSAGE_BYTES)
    if body_bytes > limit:
        raise ApiError(400, f"the request body is {body_bytes} bytes; the engine's limit "
                       f"(max_message_bytes) is {limit}", code="message_too_large")


__all__ = ["TOKENIZER_THREADS", "check_body_size", "run_tokenizer"]
