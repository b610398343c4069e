"""`chat.completion` and `chat.completion.chunk` bodies from the engine's deltas and finals.

Streaming follows OpenAI (and vLLM): first one chunk per choice with `delta: {role:
"assistant", content: ""}`, then content chunks as text arrives, then per choice a chunk with an
empty delta and its `finish_reason` (plus vLLM's `stop_reason`), then, with
`stream_options.include_usage`, one chunk with `choices: []` and the usage.
"""
from __future__ import annotations

from pagedrun.server.http.logprobs import chat_logprobs, prompt_logprobs_json
from pagedrun.server.http.openai_models import GenerationSpec
from pagedrun.server.http.responses import choice_index, usage_body

ROLE = "assistant"


class ChatFormat:
    """Response bodies of one chat request (`response_id`, `model` and `created` fixed)."""

    def __init__(self, spec: GenerationSpec, response_id: str, model: str, created: int,
                 decode) -> None:
        self.spec = spec
        self.response_id = response_id
        self.model = model
        self.created = created
        self.decode = decode

    def _logprobs(self, positions):
        if self.spec.logprobs is None or positions is None:
            return None
        return chat_logprobs(positions, self.spec.logprobs, self.decode)

    # -- streaming ------------------------------------------------------------------------

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.response_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def opening_chunks(self, num_jobs: int) -> list[dict]:
        return [self.chunk([{"index": choice_index(job, i, self.spec.n),
                             "delta": {"role": ROLE, "content": ""}, "logprobs": None,
                             "finish_reason": None}])
                for job in range(num_jobs) for i in range(self.spec.n)]

    def delta_chunks(self, job: int, delta) -> list[dict]:
        logprobs = self._logprobs(delta.logprobs)
        if not delta.text and not (logprobs and logprobs["content"]):
            return []  # an incomplete UTF-8 character: nothing to show yet
        return [self.chunk([{"index": choice_index(job, delta.index, self.spec.n),
                             "delta": {"content": delta.text}, "logprobs": logprobs,
                             "finish_reason": None}])]

    def final_chunks(self, job: int, completion) -> list[dict]:
        return [self.chunk([{"index": choice_index(job, o.get("index", 0), self.spec.n),
                             "delta": {}, "logprobs": None,
                             "finish_reason": o.get("finish_reason"),
                             "stop_reason": o.get("stop_reason")}])
                for o in completion.outputs]

    def usage_chunk(self, completions) -> dict:
        return self.chunk([], usage_body(completions))

    # -- whole response -------------------------------------------------------------------

    def response(self, completions: list) -> dict:
        choices = []
        for job, completion in enumerate(completions):
            for o in completion.outputs:
                choices.append({
                    "index": choice_index(job, o.get("index", 0), self.spec.n),
                    "message": {"role": ROLE, "content": o.get("text", "")},
                    "logprobs": self._logprobs(o.get("logprobs")),
                    "finish_reason": o.get("finish_reason"),
                    "stop_reason": o.get("stop_reason"),
                })
        choices.sort(key=lambda c: c["index"])
        body = {"id": self.response_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_body(completions)}
        if self.spec.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(completions[0].prompt_logprobs,
                                                           self.decode)
        return body
