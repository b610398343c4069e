"""The offline API with vLLM's names: `LLM(...).generate(prompts, sampling_params)` and
`.chat(messages, sampling_params)`, taking vLLM's forms (docs/engine_api.md, "Offline API").

generate's prompts: a string, a list of token ids, a TextPrompt {"prompt": str} or a TokensPrompt
{"prompt_token_ids": [...]} dict, or a list mixing them (runtime/prompt_inputs.py turns each into
the engine's form, and refuses what the engine cannot serve, naming the prompt). chat's messages:
one conversation or a list of them. Keywords and positions are vLLM's: `use_tqdm`,
`lora_request`, `priority`, `tokenization_kwargs` on generate; chat's template options, its
`chat_template_content_format`, `tokenization_kwargs` and `mm_processor_kwargs`. What the
engine cannot honour is refused with a ValueError that says why, never ignored.

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
from collections.abc import Callable, Sequence
from typing import Any

from pagedrun.runtime.engine import LLMEngine
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.outputs import CompletionOutput, RequestOutput
from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.lora.lora_request import LoRARequest
from pagedrun.runtime.prompt_inputs import (PromptInput, PromptInputError,
                                            parse_conversations, parse_prompts)
from pagedrun.runtime.sampling_params import RequestOutputKind, SamplingParams

Message = dict
# tokenization_kwargs keys the offline API honours (vLLM passes any to the tokenizer).
TOKENIZATION_KWARGS = ("add_special_tokens",)
# The progress bar's labels (use_tqdm=True).
PROGRESS_DESCRIPTION = "requests"
PROGRESS_UNIT = "req"

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

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when sampling_params is None: SamplingParams()'s
        defaults (vLLM would start from the model's generation_config.json; see
        docs/engine_api.md)."""
        return SamplingParams()

    def generate(self, prompts: Any,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """prompts: one prompt or a list of them, each a string, a list of token ids, a
        TextPrompt {"prompt": str} or a TokensPrompt {"prompt_token_ids": [...]} (vLLM's
        PromptType; runtime/prompt_inputs.py). sampling_params: one for every prompt or one per
        prompt. use_tqdm: True draws a progress bar on stderr when it is a terminal, a callable
        makes the bar (called as tqdm is), False draws none. lora_request: the adapter of every
        prompt, or one per prompt (None: the base model). priority: one int per prompt; only 0
        (the engine schedules first come, first served). tokenization_kwargs: only
        add_special_tokens, for text prompts."""
        inputs = parse_prompts(prompts)
        add_special_tokens = _tokenization_option(tokenization_kwargs)
        if add_special_tokens is not None:
            inputs = [self._tokenized(p, add_special_tokens) for p in inputs]
        _check_priority(priority, len(inputs))
        return self._run(inputs, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """messages: one conversation ([{"role", "content"}, ...]) or a list of them; content
        is a string or a list of text parts (other parts are refused). vLLM's parameter order.
        The chat options apply to every conversation: `chat_template` replaces the model's
        template, `continue_final_message` continues the last (assistant) message instead of
        opening a new turn (then add_generation_prompt must be False), `tools` and
        `chat_template_kwargs` become template variables; an invalid combination raises
        ChatOptionsError (a ValueError). `chat_template_content_format`: "string" joins a
        message's text parts with a newline, "openai" hands the template the list of parts,
        "auto" is "string". tokenization_kwargs: only add_special_tokens=False (the template
        writes the special tokens). mm_processor_kwargs: refused (no multi-modal models).
        `sampling_params`, `use_tqdm` and `lora_request` as in generate."""
        if mm_processor_kwargs is not None:
            raise PromptInputError("mm_processor_kwargs: multi-modal inputs are not supported: "
                                   "this engine serves text-only models")
        if _tokenization_option(tokenization_kwargs) is True:
            raise PromptInputError("tokenization_kwargs: add_special_tokens=True is not "
                                   "supported for chat (the chat template writes the special "
                                   "tokens)")
        options = ChatOptions(chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools,
                              chat_template_kwargs=dict(chat_template_kwargs or {}))
        conversations = parse_conversations(messages, chat_template_content_format)
        return self._run([PromptInput(messages=c) for c in conversations], sampling_params,
                         chat_options=options, lora_request=lora_request, use_tqdm=use_tqdm)

    def _tokenized(self, prompt: PromptInput, add_special_tokens: bool) -> PromptInput:
        """A text prompt as token ids, encoded with the caller's add_special_tokens (the
        engine itself encodes with special tokens added)."""
        if prompt.prompt_token_ids is not None:
            return prompt
        if self.engine.tokenizer is None:
            raise PromptInputError("tokenization_kwargs: this engine has no tokenizer; send "
                                   "prompt_token_ids")
        return PromptInput(prompt=prompt.prompt, prompt_token_ids=list(
            self.engine.tokenizer.encode(prompt.prompt, add_special_tokens=add_special_tokens)))

    def _run(self, inputs: list[PromptInput],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             chat_options: ChatOptions | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             use_tqdm: bool | Callable[..., Any] = False) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, SamplingParams, len(inputs), "sampling_params",
                             "sampling_params")
        params = [p if p is not None else self.get_default_sampling_params() for p in params]
        loras = _per_prompt(lora_request, LoRARequest, len(inputs), "lora_request",
                            "lora_requests")
        extra = {} if chat_options is None else {"chat_options": chat_options}
        _check_use_tqdm(use_tqdm)  # before anything is admitted
        ids = []
        try:
            for prompt, p, lora in zip(inputs, params, loras):
                adapter = {} if lora is None else {"lora_request": lora}
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, sampling_params=_final_only(p),
                                        **prompt.engine_kwargs(), **extra, **adapter)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: the batch is refused as a whole
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        totals: dict[str, RequestOutput] = {}
        progress = _progress_bar(use_tqdm, len(ids))
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    totals[output.request_id] = _merge(totals.get(output.request_id), output)
                    if progress is not None and output.finished:
                        progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        results = [totals[i] for i in ids]
        for result, prompt in zip(results, inputs):
            result.prompt = self._prompt_text(prompt, chat_options)
        return results

    def _prompt_text(self, prompt: PromptInput, chat_options: ChatOptions | None) -> str | None:
        """RequestOutput.prompt as vLLM fills it: the text prompt, a TokensPrompt's text if it
        gave one (else None), a conversation's rendered template."""
        if prompt.messages is None:
            return prompt.prompt
        return self.engine.tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, **(chat_options or ChatOptions()).template_kwargs())


def _per_prompt(value: Any, kind: type, num_prompts: int, name: str, plural: str) -> list:
    """One value (or None) for every prompt, or a list with one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * num_prompts
    if not isinstance(value, (list, tuple)):
        raise PromptInputError(f"{name}: must be a {kind.__name__}, a list of them, or None; "
                               f"got {type(value).__name__}")
    if len(value) != num_prompts:
        raise PromptInputError(f"{name}: {num_prompts} prompts but {len(value)} {plural} (give "
                               "one for every prompt, or exactly one per prompt)")
    for i, v in enumerate(value):
        if v is not None and not isinstance(v, kind):
            raise PromptInputError(f"{name}[{i}]: must be a {kind.__name__} or None, got "
                                   f"{type(v).__name__}")
    return list(value)


def _check_priority(priority: Sequence[int] | None, num_prompts: int) -> None:
    """vLLM's priority list: one int per prompt; the engine has no priority scheduling
    (EngineConfig has no scheduling_policy), so, as vLLM without it, only 0 is accepted."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise PromptInputError(f"priority: must be a list of {num_prompts} ints (one per "
                               "prompt)")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in priority):
        raise PromptInputError("priority: must hold ints")
    if any(priority):
        raise PromptInputError("priority: priority scheduling is not supported (requests run "
                               "first come, first served); every priority must be 0")


def _tokenization_option(tokenization_kwargs: dict[str, Any] | None) -> bool | None:
    """tokenization_kwargs' add_special_tokens (None: not given); any other key is refused."""
    if tokenization_kwargs is None:
        return None
    if not isinstance(tokenization_kwargs, dict):
        raise PromptInputError("tokenization_kwargs: must be a dict or None")
    unknown = sorted(set(tokenization_kwargs) - set(TOKENIZATION_KWARGS), key=str)
    if unknown:
        raise PromptInputError(f"tokenization_kwargs: {', '.join(map(repr, unknown))} not "
                               f"supported (only {', '.join(TOKENIZATION_KWARGS)})")
    flag = tokenization_kwargs.get("add_special_tokens")
    if flag is not None and not isinstance(flag, bool):
        raise PromptInputError("tokenization_kwargs: add_special_tokens must be a boolean")
    return flag


def _check_use_tqdm(use_tqdm: Any) -> None:
    if not (isinstance(use_tqdm, bool) or use_tqdm is None or callable(use_tqdm)):
        raise PromptInputError(f"use_tqdm: must be a boolean or a callable that makes a "
                               f"progress bar, got {type(use_tqdm).__name__}")


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int):
    """The bar that counts finished requests, or None. True: tqdm on stderr, drawn only when
    stderr is a terminal (tqdm's disable=None), so logs and benchmarks stay clean; a callable:
    called as tqdm is, always (vLLM's form for a custom bar)."""
    if use_tqdm is False or use_tqdm is None:
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        return tqdm(total=total, desc=PROGRESS_DESCRIPTION, unit=PROGRESS_UNIT, disable=None)
    return use_tqdm(total=total, desc=PROGRESS_DESCRIPTION, unit=PROGRESS_UNIT)


def _final_only(params: SamplingParams | None) -> SamplingParams:
    """A copy of `params` with output_kind FINAL_ONLY (the caller's object is left alone)."""
    params = copy.copy(params) if params is not None else SamplingParams()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params
