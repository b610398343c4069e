"""Engine logprobs -> OpenAI's two logprobs shapes.

In: what the ZeroMQ client returns (vLLM's shape, protocol 1.3): per position a dict
{token_id: Logprob(logprob, rank, decoded_token)}, the sampled (or prompt) token first, then the
top-k by rank (the sampled token appears once when it is among them).

Out:
- chat (`logprobs.content[i]`): {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}
  where `top_logprobs` are the k most likely tokens, best first (OpenAI's meaning: the sampled
  token is among them only when it ranks within k);
- completions (legacy): {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset},
  where each `top_logprobs` map holds the top k plus the sampled token (OpenAI: "up to
  logprobs + 1 elements"); the echoed prompt's first token has null logprob and top map.

A token's text is its `decoded_token` (the engine decodes each id alone); without one (an engine
without a tokenizer) the gateway's tokenizer decodes it, else it is `token_id:N` (vLLM's
spelling for ids as tokens). JSON has no -inf: a logprob below -9999 is sent as -9999 (vLLM's
floor too).
"""
from __future__ import annotations

import math
from typing import Callable

MIN_JSON_LOGPROB = -9999.0
UNRANKED = 1 << 62  # sorts an entry without a rank after every ranked one

Decode = Callable[[int], str] | None


def json_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    if math.isnan(value):
        return MIN_JSON_LOGPROB
    return max(float(value), MIN_JSON_LOGPROB)


def token_text(token_id: int, entry, decode: Decode) -> str:
    text = getattr(entry, "decoded_token", None)
    if text is not None:
        return text
    if decode is not None:
        return decode(token_id)
    return f"token_id:{token_id}"


def _top(position: dict, k: int) -> list[tuple[int, object]]:
    """The k best entries of a position, by rank."""
    ranked = sorted(position.items(), key=lambda kv: (
        kv[1].rank if kv[1].rank is not None else UNRANKED))
    return ranked[:k]


def _sampled(position: dict) -> tuple[int, object]:
    return next(iter(position.items()))


def _chat_token(token_id: int, entry, decode: Decode) -> dict:
    text = token_text(token_id, entry, decode)
    return {"token": text, "logprob": json_logprob(entry.logprob),
            "bytes": list(text.encode("utf-8"))}


def chat_logprobs(positions: list[dict], k: int, decode: Decode) -> dict:
    """`choices[i].logprobs` of a chat completion (or of one chunk) for these positions."""
    content = []
    for position in positions:
        token_id, entry = _sampled(position)
        item = _chat_token(token_id, entry, decode)
        item["top_logprobs"] = [_chat_token(t, e, decode) for t, e in _top(position, k)]
        content.append(item)
    return {"content": content}


class CompletionLogprobs:
    """Builds completions' logprobs for one choice; keeps the running `text_offset` so a stream's
    chunks continue each other's offsets."""

    def __init__(self, k: int, decode: Decode, text_offset: int = 0) -> None:
        self.k = k
        self.decode = decode
        self.text_offset = text_offset

    def _entry(self, out: dict, text: str, logprob, top) -> None:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.text_offset)
        self.text_offset += len(text)

    def build(self, positions: list[dict], prompt_positions: list | None = None,
              first_prompt_token: str | None = None) -> dict:
        """Logprobs of generated `positions`, after those of the echoed prompt when
        `prompt_positions` is given (entry 0 None: its token is `first_prompt_token`)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, position in enumerate(prompt_positions or ()):
            if position is None:
                if i == 0 and first_prompt_token is not None:
                    self._entry(out, first_prompt_token, None, None)
                continue
            self._add_position(out, position)
        for position in positions:
            self._add_position(out, position)
        return out

    def _add_position(self, out: dict, position: dict) -> None:
        token_id, entry = _sampled(position)
        top = {}
        for t, e in [(token_id, entry), *_top(position, self.k)]:
            top.setdefault(token_text(t, e, self.decode), json_logprob(e.logprob))
        self._entry(out, token_text(token_id, entry, self.decode), json_logprob(entry.logprob),
                    top)


def prompt_logprobs_json(prompt_positions: list | None, decode: Decode) -> list | None:
    """vLLM's `prompt_logprobs` extra field: per prompt token None (token 0) or
    {token_id: {logprob, rank, decoded_token}} (JSON object keys are strings)."""
    if prompt_positions is None:
        return None
    return [None if p is None else {
        str(t): {"logprob": json_logprob(e.logprob), "rank": e.rank,
                 "decoded_token": token_text(t, e, decode)} for t, e in p.items()}
        for p in prompt_positions]
