"""The offline API with vLLM's names: `LLM(...).generate(prompts, sampling_params)` and
`.chat(...)`.

A thin loop over LLMEngine: add every request, step until all have finished, return one final
RequestOutput per prompt in input order. Every request runs with output_kind FINAL_ONLY (on a
copy of the caller's SamplingParams, whatever output_kind they carry): the engine hands back
each request's whole output once, and no per-step deltas are built for an offline batch.
`_merge` accumulates streaming deltas into a total (the tests' and clients' drivers use it).

Multi-LoRA with vLLM's names: `LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16,
max_cpu_loras=8)` (EngineConfig fields), then `generate(..., lora_request=LoRARequest(name, id,
path))` -- one adapter for every prompt, or a list with one entry (or None) per prompt; `chat`
takes the same keyword.

Speculative decoding with vLLM's name (EngineConfig's speculative_config, a dict or a
SpeculativeConfig; docs/engine_api.md): `LLM(model=..., speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})`.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence
from typing import Any

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.outputs import CompletionOutput, RequestOutput
from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.lora.lora_request import LoRARequest
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | Sequence[int]
Message = dict


def _merge(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulate one streaming delta into the running total of a request."""
    if total is None:
        total = RequestOutput(request_id=delta.request_id, prompt_token_ids=delta.prompt_token_ids,
                              outputs=[], arrival_time=delta.arrival_time)
    by_index = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = by_index[c.index] = CompletionOutput(
                index=c.index, logprobs=None if c.logprobs is None else [])
        acc.token_ids.extend(c.token_ids)
        acc.text += c.text
        if c.logprobs is not None:
            acc.logprobs.extend(c.logprobs)
        acc.cumulative_logprob = c.cumulative_logprob  # a total already, in every delta
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.usage = delta.usage
    total.prompt_logprobs = delta.prompt_logprobs or total.prompt_logprobs
    total.first_scheduled_time = delta.first_scheduled_time
    total.first_token_time = delta.first_token_time
    total.finished_time = delta.finished_time
    total.error = delta.error
    return total


class LLM:
    """An engine for offline batch generation.

    model: Hugging Face directory, .gguf file, or None (the default model).
    device: "auto" (cuda when CuPy sees a GPU, else cpu), "cpu" (numpy), "sim" (the CUDA kernels
    on the CPU harness), "cuda" (DeviceNotAvailableError without a GPU). Other keywords are
    EngineConfig fields.
    """

    def __init__(self, model: str | None = None, device: str = "auto", *, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 num_kv_blocks: int | None = None, seed: int = 0, **engine_kwargs) -> None:
        config = EngineConfig(model=model, device=device, block_size=block_size,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              num_kv_blocks=num_kv_blocks, seed=seed, **engine_kwargs)
        self.engine = LLMEngine(config)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (tests build engines around in-memory models)."""
        llm = cls.__new__(cls)
        llm.engine, llm._counter = engine, 0
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, one token-id list, or a list of token-id lists.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        return self._run([("prompt_token_ids" if not isinstance(p, str) else "prompt", p)
                          for p in prompts], sampling_params, lora_request=lora_request)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """messages: one conversation ([{"role", "content"}, ...]) or a list of them. The chat
        options (vLLM's LLM.chat keywords) apply to every conversation: `chat_template`
        replaces the model's template, `continue_final_message` continues the last
        (assistant) message instead of opening a new turn (then add_generation_prompt must be
        False), `tools` and `chat_template_kwargs` become template variables. An invalid
        combination raises ChatOptionsError (a ValueError). `lora_request` as in generate."""
        options = ChatOptions(chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools,
                              chat_template_kwargs=dict(chat_template_kwargs or {}))
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self._run([("messages", list(m)) for m in messages], sampling_params,
                         chat_options=options, lora_request=lora_request)

    def _run(self, inputs: list[tuple[str, object]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             chat_options: ChatOptions | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(f"{len(inputs)} prompts but {len(params)} sampling_params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(inputs)
        else:
            loras = list(lora_request)
            if len(loras) != len(inputs):
                raise ValueError(f"{len(inputs)} prompts but {len(loras)} lora_requests")
        extra = {} if chat_options is None else {"chat_options": chat_options}
        ids = []
        try:
            for (kind, value), p, lora in zip(inputs, params, loras):
                adapter = {} if lora is None else {"lora_request": lora}
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, sampling_params=_final_only(p),
                                        **{kind: list(value) if kind != "prompt" else value},
                                        **extra, **adapter)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: the batch is refused as a whole
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        totals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                totals[output.request_id] = _merge(totals.get(output.request_id), output)
        return [totals[i] for i in ids]


def _final_only(params: SamplingParams | None) -> SamplingParams:
    """A copy of `params` with output_kind FINAL_ONLY (the caller's object is left alone)."""
    params = copy.copy(params) if params is not None else SamplingParams()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params
