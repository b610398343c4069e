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


def engine_body_limit(model_info: dict) -> int:
    """The engine's max_message_bytes (MODEL_INFO_REPLY's server.max_message_bytes): the limit
    a GENERATE carrying a /tokenize or /detokenize body's text meets (read_json's engine_limit)."""
    return int((model_info.get("server") or {}).get("max_message_bytes")
               or DEFAULT_MAX_MESSAGE_BYTES)


__all__ = ["TOKENIZER_THREADS", "engine_body_limit", "run_tokenizer"]
