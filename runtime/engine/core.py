"""LLMEngine: admission, abort, dispatch to a stepper, stats. The public seam of the engine
(docs/engine_api.md): string request ids and SamplingParams in, RequestOutputs out.

What a step does lives beside this file, one job each:
  runtime/engine/step.py              the fault-contained step skeleton (schedule, plan, run,
                                      complete) and the failure rules;
  runtime/engine/steppers.py          when its phases run: synchronous, pipelined;
  runtime/engine/async_stepper.py     ... asynchronous (step N+1 launched before N is read);
  runtime/engine/sampling_plan.py     which sequence samples from which logits row; sampling;
  runtime/engine/output_processor.py  tokens -> text, stops, logprobs, RequestOutputs;
  runtime/engine/request_table.py     live requests and sequences by id;
  runtime/engine/runner_setup.py      the runner with its KV pools, draft model and graphs;
  runtime/spec_decode/spec_step.py    speculative decoding's part of a step;
  runtime/lora/pinning.py             which adapters are pinned, per request and per step.
The device is the backend's business: the engine asks the Backend object (its declared
`capabilities`) and never branches on a device string.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
import time

import numpy as np

from pagedrun.runtime.admission import render_chat, truncate_prompt, verify_params
from pagedrun.runtime.backends import checkpoint_dtype, keeps_gguf_blocks, make_backend
from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.errors import (ERR_CAPACITY, ERR_DUPLICATE, ERR_EMPTY, ERR_INVALID,
                                     ERR_TOO_LONG, RequestError)
from pagedrun.runtime.kv_capacity import resolve_max_model_len
from pagedrun.runtime.lora.adapter_cache import AdapterCache
from pagedrun.runtime.lora.lora_request import LoRARequest
from pagedrun.runtime.lora.pinning import LoRAPins, cache_salt
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.model_loader import load_model, resolve_quantization
from pagedrun.runtime.outputs import RequestOutput
from pagedrun.runtime.prompt_inputs import PromptInputError, resolve_request_prompt
from pagedrun.runtime.request import Request
from pagedrun.runtime.sampling_params import SamplingParams, SamplingParamsError
from pagedrun.runtime.spec_decode.draft_model import DraftModelProposer
from pagedrun.runtime.spec_decode.spec_step import SpecDecodeStep
from pagedrun.runtime.spec_decode.speculator import Speculator
from pagedrun.runtime.stop_checker import FINISH_ABORT
from pagedrun.runtime.weights import ModelWeights

from .async_stepper import AsyncStepper
from .output_processor import OutputProcessor
from .request_table import RequestTable
from .runner_setup import draft_runner, start_runner
from .step import StepSkeleton
from .steppers import PipelinedStepper, SyncStepper

log = logging.getLogger("pagedrun.engine")


class LLMEngine:
    """Which stepper runs (chosen once, at construction):
    - PipelinedStepper when the runner keeps several batches in flight (pipeline parallelism:
      one virtual engine -- a scheduler with its share of the KV blocks -- per stage);
    - else AsyncStepper when EngineConfig.async_scheduling is on (a backend with a device to
      overlap with, no speculation, one rank); it steps synchronously whenever a request
      needs its last token before the next step can be planned;
    - else SyncStepper: schedule -> execute -> sample -> postprocess, one step at a time.
    """

    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 weights: ModelWeights | None = None, tokenizer=None,
                 draft_model: tuple[ModelConfig, ModelWeights] | None = None) -> None:
        """Load the model (or take an in-memory one), size the KV pools, start the scheduler.

        `model_config` + `weights` (+ optional `tokenizer`) bypass loading `config.model`; tests
        use this. Without a tokenizer, prompts must be token ids and stop strings are refused.
        `draft_model`: (config, weights) of the speculative draft model instead of loading
        speculative_config's `model` path (method "draft_model" only).
        """
        from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

        self.config = config
        self.model_name = config.model or "default"
        model_given = model_config is not None
        # What quantization None means here (a .gguf on a backend that computes on the file's
        # blocks: "gguf"), settled before loading.
        self.quantization = resolve_quantization(
            config.quantization, config.model, keeps_gguf_blocks(config.device), config.dtype,
            config.world_size, model_given=model_given)
        if model_config is None:  # tensor parallel: each rank reads its own shard
            model_config, weights, tokenizer = load_model(config.model, config.world_size == 1,
                                                          quantization=self.quantization)
        self.model_config = model_config
        self.tokenizer = tokenizer
        # The one place that picks ops. dtype "auto" serves a checkpoint read from disk in its
        # own precision where the device can (a bf16 checkpoint on cpu: the bf16 backend; one
        # process: tensor-parallel ranks build their backends from EngineConfig.dtype).
        dtype = config.dtype
        if self.quantization == "none" and not model_given and config.world_size == 1:
            dtype = checkpoint_dtype(config.device, dtype, model_config.torch_dtype)
            if dtype != config.dtype:
                log.info("dtype auto: %s, the checkpoint's own precision (--dtype float32 for "
                         "the float32 reference)", dtype)
        self.backend = make_backend(config.device, dtype, quantization=self.quantization,
                                    kv_cache_dtype=config.kv_cache_dtype, cpu_isa=config.cpu_isa)
        self.device = self.backend.name
        self.backend.check_model(model_config, config.block_size)  # not mid-step
        self.block_size = config.block_size
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        self.lora_config = config.lora_config()  # None: LoRA off
        spec_config = config.spec_config()  # None: speculative decoding off
        self.draft_runner = draft_runner(config, spec_config, draft_model, model_config,
                                         self.backend, self.max_model_len)  # None: no draft
        self.runner = start_runner(config, model_config, weights, self.backend,
                                   self.max_model_len, self.lora_config, self.draft_runner)
        self.num_virtual_engines = self.runner.pipeline_depth
        self.blocks_per_virtual_engine = self.runner.num_gpu_blocks
        self.num_kv_blocks = self.blocks_per_virtual_engine * self.num_virtual_engines
        self.num_cpu_blocks = self.runner.num_cpu_blocks
        self.bytes_per_block = self.runner.kv_bytes_per_block() + self._draft_bytes_per_block()
        # The model's EOS ids plus the tokenizer's (chat models end turns with the latter).
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            frozenset() if tokenizer_eos is None else frozenset([tokenizer_eos]))
        scheduler_config = SchedulerConfig(
            num_gpu_blocks=self.blocks_per_virtual_engine, block_size=self.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks, preemption_mode=config.preemption_mode,
            check_invariants=config.check_invariants,
            # The virtual engines share the device's adapter slots: max_loras // P each.
            max_loras=(self.lora_config.max_loras // self.num_virtual_engines
                       if self.lora_config else 0),
            num_speculative_tokens=spec_config.num_speculative_tokens if spec_config else 0)
        # One per virtual engine; a scheduler fault replaces its entry (StepSkeleton.reset).
        self.schedulers = [Scheduler(scheduler_config) for _ in range(self.num_virtual_engines)]
        self.lora = (LoRAPins(AdapterCache(self.lora_config, load=self.runner.load_adapter),
                              self.schedulers, self.runner.apply_lora_writes)
                     if self.lora_config else None)
        self.table = RequestTable(self.num_virtual_engines, tokenizer,
                                  on_finish=self._release_adapter if self.lora else None)
        # The backend's sampler: numpy on cpu, the sampling kernels on sim / cuda (same draws).
        self.sampler = self.backend.sampler(sorted(self.eos_token_ids), seed=config.seed,
                                            logprobs_mode=config.logprobs_mode)
        self.output_processor = OutputProcessor(self.table, tokenizer, self.eos_token_ids,
                                                self.max_model_len)
        self.speculator = self._speculator(spec_config)
        spec_step = None
        if self.speculator is not None:
            backend = self.backend
            spec_step = SpecDecodeStep(
                self.speculator, self.table.seqs, logprobs_mode=config.logprobs_mode,
                max_model_len=self.max_model_len, generator=self.sampler.generator,
                to_host=backend.to_host if backend.logits_on_device else (lambda rows: rows))
        self.skeleton = StepSkeleton(self.schedulers, self.table, self.runner, self.sampler,
                                     self.output_processor, spec=spec_step, lora=self.lora,
                                     new_scheduler=Scheduler)
        # Salts that keep prompt-logprob requests out of the prefix cache (every prompt position
        # must be computed to have its logits); 0 is everyone else's shared salt.
        self._salts = itertools.count(1)
        self._prompt_tokens_total = 0
        self._log_capacity()
        self.stepper = self._stepper()

    # ------------------------------------------------------------------ construction
    def _speculator(self, spec_config) -> Speculator | None:
        if spec_config is None:
            return None
        draft = (DraftModelProposer(self.draft_runner, sorted(self.eos_token_ids))
                 if self.draft_runner is not None else None)
        return Speculator(spec_config, sorted(self.eos_token_ids), self.config.logprobs_mode,
                          self.backend.rejection_sampler(), draft,
                          self.backend.capabilities.spec_disable_by_batch_size)

    def _stepper(self):
        """The stepper this engine runs (class docstring)."""
        if self.num_virtual_engines > 1:
            return PipelinedStepper(self.skeleton, self._admit)
        if self.config.async_scheduling:
            why_not = self._async_refusal()
            if why_not is not None:
                raise EngineConfigError(f"async_scheduling: {why_not}")
            return AsyncStepper(self.skeleton, self.backend.to_device)
        return SyncStepper(self.skeleton)

    def _async_refusal(self) -> str | None:
        """Why this engine cannot schedule asynchronously, or None."""
        if not self.backend.capabilities.async_scheduling:
            return (f"the {self.backend.name} backend has no device to overlap with (sim and "
                    f"cuda do)")
        if self.speculator is not None:
            return "not with speculative decoding (the proposer reads the latest tokens)"
        if self.config.world_size > 1:
            return "not with tensor or pipeline parallelism yet"
        return None

    def _draft_bytes_per_block(self) -> int:
        return self.draft_runner.kv_bytes_per_block() if self.draft_runner is not None else 0

    def _log_capacity(self) -> None:
        info = self.model_info()
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/block%s); "
                 "max_model_len %d -> max concurrency at max length %.2f; device %s",
                 self.num_kv_blocks, self.block_size, info["kv_capacity_tokens"],
                 self.num_kv_blocks * self.bytes_per_block / 2**20, self.bytes_per_block,
                 f", of which the draft model's {self._draft_bytes_per_block()}"
                 if self.draft_runner is not None else "",
                 self.max_model_len, info["max_concurrency_at_max_len"], self.device)

    def model_info(self) -> dict:
        blocks_per_max_len = math.ceil(self.max_model_len / self.block_size)
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_capacity_tokens": self.num_kv_blocks * self.block_size,
            "max_concurrency_at_max_len": self.num_kv_blocks / blocks_per_max_len,
            "vocab_size": self.model_config.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids),
            "device": self.device,
            "dtype": self.backend.dtype_name,
            "quantization": self.quantization,  # "none", or the weights' form (e.g. "gguf")
            "num_virtual_engines": self.num_virtual_engines,
            "enable_lora": self.lora_config is not None,
            "lora_adapters": [{"name": r.lora_name, "id": r.lora_int_id}
                              for r in self.list_lora_requests()],
        }

    # ------------------------------------------------------------------ adapters (vLLM's API)
    def _require_lora(self) -> LoRAPins:
        if self.lora is None:
            raise RequestError(ERR_INVALID, "LoRA is not enabled on this engine "
                                            "(enable_lora=True / --enable-lora)")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter ahead of use. Raises RequestError (ERR_INVALID) when
        LoRA is off or the adapter cannot be served, naming the reason."""
        return self._require_lora().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it is not known. Refused (LoRAInUseError) while a live
        request -- running or waiting -- names it."""
        return self._require_lora().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """lora_int_ids of the known adapters."""
        return {r.lora_int_id for r in self.list_lora_requests()}

    def list_lora_requests(self) -> list[LoRARequest]:
        """Every adapter added (or used) and not removed, by lora_int_id."""
        return self.lora.known() if self.lora is not None else []

    def _release_adapter(self, request: Request) -> None:
        self.lora.release(request.request_id)

    # ------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt=None, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    *, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None,
                    sampling_params: SamplingParams | None = None,
                    chat_options: ChatOptions | None = None) -> None:
        """Admit a request or raise RequestError (then nothing of it was admitted).

        vLLM's form: `add_request(request_id, prompt, params, arrival_time, lora_request)`,
        `prompt` any of vLLM's single prompts (a string, a list of token ids, a TextPrompt or
        TokensPrompt dict; runtime/prompt_inputs.py). The engine's own keywords do the same:
        exactly one of prompt / prompt_token_ids / messages, and `sampling_params` (an alias of
        `params`: give one).
        The request runs on its own copy of the parameters (admission sets fields derived
        from the model on it: the bad words' token ids), so callers may share one object
        between requests. `chat_options` (messages only) say how the chat template renders.
        `lora_request`: run under that adapter (LoRA must be enabled; it is loaded now if it is
        not known yet, so a bad adapter fails here, not mid-flight).
        Checks, in order: the parameters alone (SamplingParams.validate); the prompt (rendered,
        tokenized, cut to `truncate_prompt_tokens`); the parameters against the model (vLLM's
        SamplingParams.verify: token ids in the vocabulary, logprobs within `max_logprobs`,
        bad words through the tokenizer); the engine's capacity.
        """
        if params is not None and sampling_params is not None:
            raise RequestError(ERR_INVALID, "give the sampling parameters once: params "
                                            "(vLLM's positional name) or sampling_params")
        sampling_params = params if params is not None else sampling_params
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(ERR_INVALID, "request_id must be a non-empty string")
        if request_id in self.table:
            raise RequestError(ERR_DUPLICATE, f"request id {request_id!r} is already running")
        params = copy.copy(sampling_params) if sampling_params is not None else SamplingParams()
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise RequestError(ERR_INVALID, str(exc)) from None
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids, messages, chat_options)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        verify_params(params, self.model_config.vocab_size, self.config.max_logprobs,
                      self.tokenizer)
        self._check_admissible(token_ids, params)
        lora_id = 0
        if lora_request is not None:
            lora_id = self._require_lora().admit(request_id, lora_request)

        request = Request(request_id, token_ids, params,
                          arrival_time if arrival_time is not None else time.monotonic())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # token 0 has no context
        parent = self.table.new_sequence(request, 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        salt = (next(self._salts) if params.prompt_logprobs is not None
                else cache_salt(lora_id) if lora_id else 0)
        ve = self.table.least_loaded_virtual_engine()
        request.virtual_engine = ve
        admission = (parent.seq_id, np.asarray(token_ids, dtype=np.int32), max_tokens, salt,
                     lora_id)
        if not self.stepper.defer_admission(ve, request, admission):
            try:
                self._admit(ve, admission)
            except ValueError as exc:
                self.table.forget_sequence(parent.seq_id)
                raise RequestError(ERR_CAPACITY, str(exc)) from None
        self.table.add(request)
        if lora_id:
            self.lora.track(request_id, lora_request)
        self._prompt_tokens_total += len(token_ids)

    def _admit(self, ve: int, admission: tuple) -> None:
        seq_id, token_ids, max_tokens, salt, lora_id = admission
        self.schedulers[ve].add_request(seq_id, token_ids, max_tokens, cache_salt=salt,
                                        lora_id=lora_id)

    def _prompt_token_ids(self, prompt, prompt_token_ids, messages, chat_options) -> list[int]:
        try:
            given = resolve_request_prompt(prompt, prompt_token_ids, messages)
        except PromptInputError as exc:
            raise RequestError(ERR_INVALID, str(exc)) from None
        if chat_options is not None and given.messages is None:
            raise RequestError(ERR_INVALID, "chat options (chat_template, add_generation_prompt, "
                                            "continue_final_message, tools, "
                                            "chat_template_kwargs) apply to messages only")
        if given.prompt_token_ids is not None:
            ids = given.prompt_token_ids
        elif self.tokenizer is None:
            raise RequestError(ERR_INVALID, "this engine has no tokenizer; send prompt_token_ids")
        elif given.prompt is not None:
            ids = self.tokenizer.encode(given.prompt)
        else:
            ids = render_chat(self.tokenizer, given.messages, chat_options)
        if not ids:
            raise RequestError(ERR_EMPTY, "the prompt has no tokens")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(ERR_INVALID, f"prompt token ids must lie in [0, {vocab})")
        return ids

    def _check_admissible(self, token_ids: list[int], params: SamplingParams) -> None:
        prompt_len = len(token_ids)
        if prompt_len > self.max_model_len:
            raise RequestError(ERR_TOO_LONG, f"prompt has {prompt_len} tokens, more than "
                                             f"max_model_len {self.max_model_len}")
        if params.n > self.config.max_num_seqs:
            # The n sequences are forked together after the first token: they must fit in
            # one batch.
            raise RequestError(ERR_CAPACITY, f"n={params.n} sequences can never run together: "
                                             f"max_num_seqs is {self.config.max_num_seqs}")
        # The KV a sequence may need at its longest (the scheduler's rule: prompt + max_tokens,
        # counting the last token's slot, so both refuse exactly the same requests).
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len
        longest = min(prompt_len + max_new, self.max_model_len)
        blocks = math.ceil(longest / self.block_size)
        if blocks > self.blocks_per_virtual_engine:
            raise RequestError(ERR_CAPACITY, f"needs {blocks} KV blocks ({longest} tokens) but the "
                                             f"whole pool has {self.blocks_per_virtual_engine}"
                                             + (" per virtual engine" if
                                                self.num_virtual_engines > 1 else ""))

    # ------------------------------------------------------------------ abort
    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; the next step() returns its final output ("abort")."""
        request = self.table.requests.get(request_id)
        if request is None or request.finished:
            return False
        scheduler = self.schedulers[request.virtual_engine]
        for seq in request.seqs:
            if not seq.finished:
                # Its blocks are free now; if its batch is in flight (pipelining), nothing
                # reuses them before that batch is collected: only its own engine allocates
                # them, at its next schedule, after the collect.
                scheduler.abort_request(seq.seq_id)
                seq.finish_reason = FINISH_ABORT
        self.table.finish(request)
        self.table.pending_final.append(request)
        return True

    # ------------------------------------------------------------------ step
    def has_unfinished_requests(self) -> bool:
        return self.table.has_unfinished() or self.stepper.has_in_flight()

    def step(self) -> list[RequestOutput]:
        """One iteration of the stepper (class docstring). Returns every delta (the requests
        aborted since the last step end here too). Faults are contained as
        runtime/engine/step.py says; EngineDeadError when the engine cannot go on."""
        return self.stepper.step()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (one device: nothing to do). Idempotent."""
        self.runner.close()

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict:
        per_engine = [scheduler.get_stats() for scheduler in self.schedulers]
        s = {key: sum(stats[key] for stats in per_engine) for key in (
            "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions", "num_free_blocks", "num_total_blocks")}
        s["kv_cache_usage"] = (per_engine[0]["kv_cache_usage"] if len(per_engine) == 1 else
                               1.0 - s["num_free_blocks"] / max(1, s["num_total_blocks"]))
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"],
            "kv_cache_usage_perc": s["kv_cache_usage"],
            "prefix_cache_queries": s["prefix_cache_queries"],
            "prefix_cache_hits": s["prefix_cache_hits"],
            "num_preemptions_total": s["num_preemptions"],
            "num_free_blocks": s["num_free_blocks"],
            "num_total_blocks": s["num_total_blocks"],
            "prompt_tokens_total": self._prompt_tokens_total,
            "generation_tokens_total": self.output_processor.generation_tokens_total,
            **(self.skeleton.spec.counters() if self.skeleton.spec is not None else {}),
        }
