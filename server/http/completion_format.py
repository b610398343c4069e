"""`text_completion` bodies (whole and streamed) from the engine's deltas and finals.

`echo` puts the prompt's text before each choice's text (and, with `logprobs`, the prompt's
tokens before the generated ones: the engine is asked for prompt logprobs of the same k). While
streaming, the echo rides on each choice's first chunk, because the prompt logprobs arrive with
the request's first DELTA. Each choice's chunks carry consecutive `text_offset`s.
"""
from __future__ import annotations

from pagedrun.server.http.logprobs import CompletionLogprobs, prompt_logprobs_json
from pagedrun.server.http.openai_models import GenerationSpec
from pagedrun.server.http.responses import choice_index, usage_body


class CompletionFormat:
    """Response bodies of one completions request. `echo_texts[j]` / `first_tokens[j]`: prompt
    j's text and its first token's text (None when unknown), used by `echo`."""

    def __init__(self, spec: GenerationSpec, response_id: str, model: str, created: int,
                 decode, echo_texts: list[str | None], first_tokens: list[str | None]) -> None:
        self.spec = spec
        self.response_id = response_id
        self.model = model
        self.created = created
        self.decode = decode
        self.echo_texts = echo_texts
        self.first_tokens = first_tokens
        self._builders: dict[int, CompletionLogprobs] = {}  # choice -> running text offset
        self._prompt_logprobs: dict[int, list] = {}          # job -> its prompt logprobs

    def _choice_parts(self, job: int, choice: int, text: str, positions) -> tuple[str, dict]:
        """(text, logprobs) of a choice's next piece; its first piece carries the echo."""
        first = choice not in self._builders
        if first:
            self._builders[choice] = CompletionLogprobs(self.spec.logprobs or 0, self.decode)
        echo = first and self.spec.echo
        if echo:
            text = (self.echo_texts[job] or "") + text
        if self.spec.logprobs is None:
            return text, None
        prompt_positions = self._prompt_logprobs.get(job) if echo else None
        return text, self._builders[choice].build(positions or [], prompt_positions,
                                                  self.first_tokens[job])

    # -- streaming ------------------------------------------------------------------------

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def opening_chunks(self, num_jobs: int) -> list[dict]:
        return []

    def delta_chunks(self, job: int, delta) -> list[dict]:
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs.setdefault(job, delta.prompt_logprobs)
        choice = choice_index(job, delta.index, self.spec.n)
        echo_due = self.spec.echo and choice not in self._builders
        if not delta.text and not delta.logprobs and not echo_due:
            return []  # an incomplete UTF-8 character: nothing to show yet
        text, logprobs = self._choice_parts(job, choice, delta.text, delta.logprobs)
        return [self.chunk([{"index": choice, "text": text, "logprobs": logprobs,
                             "finish_reason": None}])]

    def final_chunks(self, job: int, completion) -> list[dict]:
        if completion.prompt_logprobs is not None:
            self._prompt_logprobs.setdefault(job, completion.prompt_logprobs)
        chunks = []
        for o in completion.outputs:
            choice = choice_index(job, o.get("index", 0), self.spec.n)
            text, logprobs = ("", None)
            if choice not in self._builders:  # no DELTA came: the echo still goes out
                text, logprobs = self._choice_parts(job, choice, "", [])
            chunks.append(self.chunk([{"index": choice, "text": text, "logprobs": logprobs,
                                       "finish_reason": o.get("finish_reason"),
                                       "stop_reason": o.get("stop_reason")}]))
        return chunks

    def usage_chunk(self, completions) -> dict:
        return self.chunk([], usage_body(completions))

    # -- whole response -------------------------------------------------------------------

    def response(self, completions: list) -> dict:
        choices = []
        for job, completion in enumerate(completions):
            if completion.prompt_logprobs is not None:
                self._prompt_logprobs[job] = completion.prompt_logprobs
            for o in completion.outputs:
                choice = choice_index(job, o.get("index", 0), self.spec.n)
                text, logprobs = self._choice_parts(job, choice, o.get("text", ""),
                                                    o.get("logprobs"))
                body = {"index": choice, "text": text, "logprobs": logprobs,
                        "finish_reason": o.get("finish_reason"),
                        "stop_reason": o.get("stop_reason")}
                if self.spec.prompt_logprobs is not None:
                    body["prompt_logprobs"] = prompt_logprobs_json(completion.prompt_logprobs,
                                                                   self.decode)
                choices.append(body)
        choices.sort(key=lambda c: c["index"])
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_body(completions)}
