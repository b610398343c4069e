"""LLMEngine: add_request / abort_request / step() = schedule -> execute -> sample -> postprocess.

The seam (docs/engine_api.md): string request ids, SamplingParams in, RequestOutputs out.
Inside, each of a request's n sequences is one scheduler request (an int id). A step:
  1. `scheduler.schedule()` hands out the token budget and emits a SchedulerOutput;
  2. `runner.execute()` moves blocks (swap, copy-on-write), runs the forward over every scheduled
     token and returns logits of the rows that sample (plus prompt-logprob rows);
  3. the sampler draws one token per sampling sequence (n tokens from the parent's first logits
     row of an n > 1 request, one per sibling, each with its own generator);
  4. postprocess: append, check the token stops, then -- for requests with stop strings only --
     detokenize and check the stop strings (vLLM's order, runtime/stop_checker.py; a stop string
     ends the request in the step that completes it; other requests' text is decoded when an
     output's .text is first read, detokenizer.DeferredText), tell the scheduler
     (`update_from_output` frees finished blocks at once), fork the siblings of n > 1 requests
     onto the parent's blocks, and return each request's output as its output_kind asks
     (deltas by default).
Multi-LoRA (EngineConfig.enable_lora): a request may name an adapter (`lora_request=`). The
scheduler admits at most max_loras distinct adapters into `running` (a request whose adapter
finds no slot waits); after each schedule() the engine pins exactly the scheduler's active
adapters in the AdapterCache (so a slot always exists), has the runner fill newly placed slots,
and passes each row's slot to the forward. An adapter request's blocks are hashed under the salt
LORA_SALT_BIT | lora_int_id, so the prefix cache never shares KV across adapters or with the
base model.
Speculative decoding (EngineConfig.speculative_config, method "ngram"): before each schedule()
the Speculator (runtime/spec_decode/speculator.py) gives running decodes drafts; a row that
verifies k drafts gets the logits of its 1 + k positions and the rejection sampler's tokens
(accepted drafts, then a correction or bonus token), appended and stop-checked one at a time, so
no stop is overshot; the scheduler keeps only the verified KV (docs/spec_decode.md).
KV capacity is fixed at construction and logged; requests that can never run are rejected at
admission with a RequestError, never discovered mid-flight. Faults are contained per request
and per step (`step`'s docstring, docs/engine_api.md "Failures"). The device is the backend's
business: the engine asks the Backend object and never branches on a device string.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from pagedrun.runtime.backends import make_backend, resolve_device
from pagedrun.runtime.admission import render_chat, truncate_prompt, verify_params
from pagedrun.runtime.async_scheduling import AsyncScheduler
from pagedrun.runtime.chat_options import ChatOptions
from pagedrun.runtime.decode_graphs import graph_sizes
from pagedrun.runtime.detokenizer import IncrementalDetokenizer, TokenTexts, position_logprobs
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
# RequestError, DeviceNotAvailableError and the ERR_* codes live in runtime/errors.py; they are
# imported here too because `from pagedrun.runtime.engine import RequestError` is public API.
from pagedrun.runtime.errors import (ERR_CAPACITY, ERR_DUPLICATE, ERR_EMPTY,  # noqa: F401
                                     ERR_INVALID, ERR_TOO_LONG, DeviceNotAvailableError,
                                     PagedRunError, RequestError)
from pagedrun.runtime.lora.adapter_cache import AdapterCache
from pagedrun.runtime.lora.errors import LoRAInUseError
# LoRARequest is public API here too (add_request takes it; the server imports it from here).
from pagedrun.runtime.lora.lora_request import LoRARequest  # noqa: F401
from pagedrun.runtime.kv_capacity import (num_swap_blocks, plan_num_kv_blocks,
                                          resolve_max_model_len)
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.model_loader import load_model, resolve_quantization
from pagedrun.runtime.model_runner import ModelRunner, RunnerOutput
from pagedrun.runtime.outputs import RequestOutput
from pagedrun.runtime.request import Request, Sequence, take_outputs
from pagedrun.runtime.sampler import (SamplerOutput, log_softmax, make_request_generator,
                                      token_logprobs)
from pagedrun.runtime.sampling_params import SamplingParams, SamplingParamsError
from pagedrun.runtime.spec_decode.draft_model import DraftModelProposer
from pagedrun.runtime.spec_decode.speculator import Speculator, SpecRow
from pagedrun.runtime.stop_checker import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH,
                                           FINISH_STOP, check_token_stop, find_stop_string,
                                           needs_text, token_stop_bounds)
from pagedrun.runtime.weights import ModelWeights

log = logging.getLogger("pagedrun.engine")

# Steps in a row that fail outside any one request before the engine calls itself dead (a
# broken device fails every step: better an exit with every client answered than a server
# that accepts work it can never do).
MAX_CONSECUTIVE_STEP_FAILURES = 3
# Longest exception text carried into RequestOutput.error (and so onto the wire).
MAX_ERROR_CHARS = 500
# Prefix-cache salt of an adapter's requests: this bit | lora_int_id. The high bit keeps them
# apart from the prompt-logprobs salts (1, 2, ...) and from the base model's 0.
LORA_SALT_BIT = 1 << 63


class EngineDeadError(PagedRunError):
    """The engine cannot be trusted with another step (a lost rank, a device that fails every
    step): its caller fails every request still in flight and stops (the server exits 1)."""

    engine_dead = True


def _describe(where: str, exc: BaseException) -> str:
    """A short, safe message for RequestOutput.error: where it happened and the exception."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 -- an exception whose str() raises
        text = type(exc).__name__
    return f"{where} failed: {text}"[:MAX_ERROR_CHARS]


@dataclass
class SamplingBatch:
    """The sampling rows of one step, planned before it executes (LLMEngine._plan_sampling).

    targets: one (batch row, sequence, request) per sampling row, in the sampler's row order;
    row_index: per sampling row, the logits row it reads (RunnerOutput.logits has one row per
        sample row of the batch; the n sequences of an n > 1 request's first token share one);
    forks: (parent, siblings) of each n > 1 request expanded this step;
    prompt_logit_rows: batch rows whose every query token's logits are wanted (prompt logprobs).
    spec: the rows that verify drafts (speculative decoding), in batch order; they are not in
        `targets` (the rejection sampler, not the plain one, gives their tokens).
    """

    targets: list[tuple[int, Sequence, Request]] = field(default_factory=list)
    row_index: list[int] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)
    prompt_logit_rows: tuple[int, ...] = ()
    spec: list[SpecRow] = field(default_factory=list)


@dataclass
class VerifiedRows:
    """The rejection sampler's result for SamplingBatch.spec: per spec row, the emitted tokens
    (accepted drafts, then the final token) and their logprobs entries (None: not asked for, or
    the row failed: then no tokens)."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list | None] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)  # before any stop cut the row short


@dataclass
class InFlightStep:
    """A pipelined step between submit and collect: what its postprocessing needs."""

    scheduled: object          # its SchedulerOutput
    batch: SamplingBatch
    failed: dict[str, str]     # faults of single requests found while planning
    handle: int                # the executor's handle for collect


class LLMEngine:
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
        # What quantization None means here (a .gguf on cpu: "gguf"), settled before loading.
        self.quantization = resolve_quantization(
            config.quantization, config.model, resolve_device(config.device), config.dtype,
            config.world_size, model_given=model_config is not None)
        if model_config is None:  # tensor parallel: each rank reads its own shard
            model_config, weights, tokenizer = load_model(config.model,
                                                          config.world_size == 1,
                                                          quantization=self.quantization)
        self.model_config = model_config
        self.tokenizer = tokenizer
        # The one place that picks ops.
        self.backend = make_backend(config.device, config.dtype,
                                    quantization=self.quantization,
                                    kv_cache_dtype=config.kv_cache_dtype,
                                    cpu_isa=config.cpu_isa)
        self.device = self.backend.name
        self.backend.check_model(model_config, config.block_size)  # not mid-step
        self.block_size = config.block_size
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        self.lora_config = config.lora_config()  # None: LoRA off
        spec_config = config.spec_config()  # None: speculative decoding off
        self.draft_runner = self._draft_runner(spec_config, draft_model)  # None: no draft
        self.runner = self._start_runner(weights)
        # Pipeline parallelism keeps one batch in flight per stage: as many virtual engines,
        # each a scheduler with its own share of the KV blocks (runtime/distributed/pipeline.py).
        self.num_virtual_engines = getattr(self.runner, "pipeline_depth", 1)
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
        self.schedulers = [Scheduler(scheduler_config) for _ in range(self.num_virtual_engines)]
        self._ve = 0  # the virtual engine being stepped: `scheduler` is its scheduler
        self._ve_requests = [0] * self.num_virtual_engines  # unfinished requests per engine
        self._in_flight: list[InFlightStep | None] = [None] * self.num_virtual_engines
        # Per virtual engine: requests added while its batch was in flight, not yet scheduled.
        self._deferred: list[list] = [[] for _ in range(self.num_virtual_engines)]
        self._next_ve = 0
        # Which adapter sits in which device slot; loads go through the runner (its device's
        # part of the adapter: a tensor-parallel rank 0 loads its shard).
        self.adapters = (AdapterCache(self.lora_config, load=self.runner.load_adapter)
                         if self.lora_config else None)
        self._lora_pinned: set[int] = set()        # adapters pinned for the scheduler's running
        self._lora_users: dict[int, int] = {}      # lora_int_id -> live requests naming it
        self._request_lora: dict[str, LoRARequest] = {}
        # The backend's sampler: numpy on cpu, the sampling kernels on sim / cuda (same draws).
        self.sampler = self.backend.sampler(sorted(self.eos_token_ids), seed=config.seed,
                                            logprobs_mode=config.logprobs_mode)
        self._token_texts = TokenTexts(tokenizer)  # Logprob.decoded_token, cached per id
        self.speculator = None
        if spec_config is not None:
            draft = (DraftModelProposer(self.draft_runner, sorted(self.eos_token_ids))
                     if self.draft_runner is not None else None)
            self.speculator = Speculator(
                spec_config, sorted(self.eos_token_ids), config.logprobs_mode,
                self.backend.rejection_sampler(), draft,
                getattr(self.backend, "spec_disable_by_batch_size", None))
        self._seq_ids = itertools.count(1)
        # Salts that keep prompt-logprob requests out of the prefix cache (every prompt position
        # must be computed to have its logits); 0 is everyone else's shared salt.
        self._salts = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self._pending_final: list[Request] = []  # aborted since the last step
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_failed_steps = 0  # in a row, outside any one request
        self._log_capacity()
        # Asynchronous scheduling (runtime/async_scheduling.py): step N+1 scheduled and
        # launched before step N's tokens are read back.
        self._async = None
        if config.async_scheduling:
            why_not = self._async_refusal()
            if why_not is not None:
                raise EngineConfigError(f"async_scheduling: {why_not}")
            self._async = AsyncScheduler(self)

    @property
    def scheduler(self):
        """The scheduler of the virtual engine being stepped (the only one without
        pipelining)."""
        return self.schedulers[self._ve]

    @scheduler.setter
    def scheduler(self, scheduler) -> None:
        self.schedulers[self._ve] = scheduler

    # ------------------------------------------------------------------ capacity

    def _start_runner(self, weights):
        """The runner with its KV pools placed: one device's ModelRunner (the budget measured
        by profiling the runner's own model where the backend needs it), or the tensor-parallel
        executor (every rank's KV sized by the rank-0 shard's bytes per block)."""
        config = self.config
        if config.world_size > 1:
            from pagedrun.runtime.distributed.executor import start_tensor_parallel

            if weights is not None:
                raise PagedRunError("tensor parallel ranks read their shards from a model "
                                    "directory; give EngineConfig.model instead of in-memory "
                                    "weights")
            return start_tensor_parallel(config, self.model_config, self.backend,
                                         self.max_model_len)
        runner = ModelRunner(self.model_config, weights, block_size=self.block_size,
                             max_model_len=self.max_model_len, ops=self.backend,
                             lora_config=self.lora_config)
        # A draft model's KV shares the block ids: a block costs both models' bytes.
        bytes_per_block = runner.kv_bytes_per_block() + self._draft_bytes_per_block()
        max_step_tokens = min(config.max_num_batched_tokens, self.max_model_len)
        num_blocks = plan_num_kv_blocks(config, self.backend, bytes_per_block, self.max_model_len,
                                        profile=partial(runner.profile_run, max_step_tokens))
        num_swap = num_swap_blocks(config, bytes_per_block)
        runner.allocate_kv_cache(num_blocks, num_swap)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks, num_swap)
        self._capture_graphs(runner)
        return runner

    def _async_refusal(self) -> str | None:
        """Why this engine cannot schedule asynchronously, or None."""
        if not getattr(self.backend, "supports_async_scheduling", False):
            return (f"the {self.backend.name} backend has no device to overlap with (sim and "
                    f"cuda do)")
        if self.speculator is not None:
            return "not with speculative decoding (the proposer reads the latest tokens)"
        if self.config.world_size > 1:
            return "not with tensor or pipeline parallelism yet"
        return None

    def _capture_graphs(self, runner) -> None:
        """Decode graphs (runtime/decode_graphs.py) for the configured batch sizes, unless
        enforce_eager or the backend / model cannot; the log says which."""
        sizes = graph_sizes(self.config, self.backend)
        if not sizes:
            return
        why_not = runner.capture_decode_graphs(sizes)
        if why_not is not None:
            log.info("decode graphs: off (%s); every step runs eagerly", why_not)

    def _draft_runner(self, spec_config, draft_model) -> ModelRunner | None:
        """The speculative draft model's runner (KV pools placed with the target's), or None
        unless the method is "draft_model". It must share the target's vocabulary."""
        if spec_config is None or spec_config.method != "draft_model":
            if draft_model is not None:
                raise PagedRunError("draft_model given but speculative_config's method is not "
                                    "'draft_model'")
            return None
        if self.config.tensor_parallel_size > 1:
            raise PagedRunError("speculative_config: a draft model runs with "
                                "tensor_parallel_size 1 only (ngram works with any)")
        if draft_model is None:
            draft_config, draft_weights, _ = load_model(spec_config.model)
        else:
            draft_config, draft_weights = draft_model
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise PagedRunError(f"speculative_config: the draft model's vocabulary "
                                f"({draft_config.vocab_size}) differs from the target's "
                                f"({self.model_config.vocab_size}); it must share the tokenizer")
        self.backend.check_model(draft_config, self.block_size)
        return ModelRunner(draft_config, draft_weights, block_size=self.block_size,
                           max_model_len=self.max_model_len, ops=self.backend)

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

    # ------------------------------------------------------------------ adapters

    def _require_lora(self) -> AdapterCache:
        if self.adapters is None:
            raise RequestError(ERR_INVALID, "LoRA is not enabled on this engine "
                                            "(enable_lora=True / --enable-lora)")
        return self.adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register and load an adapter ahead of use (vLLM's add_lora). Raises RequestError
        (ERR_INVALID) when LoRA is off or the adapter cannot be served, naming the reason."""
        cache = self._require_lora()
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(ERR_INVALID, "lora_request must be a LoRARequest")
        try:
            cache.add(lora_request)
        except (ValueError, PagedRunError) as exc:
            raise RequestError(ERR_INVALID, str(exc)) from None
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (frees its slot and host copy); False if it is not known.
        Refused (LoRAInUseError) while a live request -- running or waiting -- names it."""
        cache = self._require_lora()
        if self._lora_users.get(lora_int_id):
            name = next((r.lora_name for r in cache.known() if r.lora_int_id == lora_int_id),
                        str(lora_int_id))
            raise LoRAInUseError(f"adapter {name!r} (lora_int_id {lora_int_id}) is in use by "
                                 f"{self._lora_users[lora_int_id]} live request(s)")
        self._sync_lora_pins()  # unpin what the scheduler no longer runs (e.g. after a reset)
        try:
            cache.remove(lora_int_id)
        except KeyError:
            return False
        return True

    def list_loras(self) -> set[int]:
        """lora_int_ids of the known adapters (vLLM's list_loras)."""
        return {r.lora_int_id for r in self.list_lora_requests()}

    def list_lora_requests(self) -> list[LoRARequest]:
        """Every adapter added (or used) and not removed, by lora_int_id."""
        if self.adapters is None:
            return []
        return sorted(self.adapters.known(), key=lambda r: r.lora_int_id)

    def _sync_lora_pins(self) -> list[tuple[int, str]]:
        """Pin exactly the adapters the scheduler's running requests hold: unpin the others
        first, then pin the new ones, resident ones before those needing a slot (the
        scheduler keeps them within max_loras, so every pin finds a slot). Returns (id, why)
        of the adapters that failed to load (their requests must fail)."""
        cache = self.adapters
        active = {i for scheduler in self.schedulers for i in scheduler.get_active_lora_ids()}
        for lora_id in self._lora_pinned - active:
            cache.release(lora_id)
        self._lora_pinned &= active
        known = {r.lora_int_id: r for r in cache.known()}
        known.update((r.lora_int_id, r) for r in self._request_lora.values())
        broken = []
        for lora_id in sorted(active - self._lora_pinned,
                              key=lambda i: cache.slot_of(i) is None):
            try:
                slot = cache.acquire(known[lora_id])
            except Exception as exc:  # noqa: BLE001 -- this adapter's requests fail
                broken.append((lora_id, _describe(f"loading adapter {lora_id}", exc)))
                continue
            if slot is None:  # the scheduler's max_loras rule makes this unreachable
                raise AssertionError(f"no device slot for adapter {lora_id}")
            self._lora_pinned.add(lora_id)
        return broken

    def _lora_slots(self, out, failed: dict[str, str]) -> np.ndarray | None:
        """Each row's adapter slot (-1: none) with the slots filled on the runner, or None
        when no row has an adapter (then the step is exactly the base model's)."""
        if self.adapters is None:
            return None
        broken = self._sync_lora_pins()
        writes = self.adapters.take_slot_writes()
        if writes:
            self.runner.apply_lora_writes(writes)
        lora_ids = out.lora_ids
        if not lora_ids.any():
            return None
        slots = np.full(out.num_reqs, -1, np.int32)
        for lora_id in np.unique(lora_ids[lora_ids > 0]).tolist():
            slot = self.adapters.slot_of(lora_id)
            if slot is not None:
                slots[lora_ids == lora_id] = slot
        for lora_id, message in broken:
            for row in np.flatnonzero(lora_ids == lora_id):
                failed.setdefault(self._seqs[int(out.req_ids[row])][0].request_id, message)
        return slots

    # ------------------------------------------------------------------ admission

    def add_request(self, request_id: str, *, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None,
                    chat_options: ChatOptions | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Admit a request or raise RequestError (then nothing of it was admitted).

        The request runs on its own copy of `sampling_params` (admission sets fields derived
        from the model on it: the bad words' token ids), so callers may share one object
        between requests. `chat_options` (messages only) say how the chat template renders.
        `lora_request`: run under that adapter (LoRA must be enabled; it is loaded now if it is
        not known yet, so a bad adapter fails here, not mid-flight).
        Checks, in order: the parameters alone (SamplingParams.validate); the prompt (rendered,
        tokenized, cut to `truncate_prompt_tokens`); the parameters against the model (vLLM's
        SamplingParams.verify: token ids in the vocabulary, logprobs within `max_logprobs`,
        bad words through the tokenizer); the engine's capacity.
        """
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(ERR_INVALID, "request_id must be a non-empty string")
        if request_id in self._requests:
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
            known = {r.lora_int_id: r for r in self.list_lora_requests()}
            if known.get(getattr(lora_request, "lora_int_id", None)) != lora_request:
                self.add_lora(lora_request)  # loaded (and checked) now, or a conflicting id
            lora_id = lora_request.lora_int_id

        request = Request(request_id, token_ids, params,
                          arrival_time if arrival_time is not None else time.monotonic())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # token 0 has no context
        parent = self._new_sequence(request, 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        salt = (next(self._salts) if params.prompt_logprobs is not None
                else LORA_SALT_BIT | lora_id if lora_id else 0)
        # The least loaded virtual engine (vLLM's choice); there is one without pipelining.
        ve = min(range(self.num_virtual_engines), key=self._ve_requests.__getitem__)
        request.virtual_engine = ve
        admit = (parent.seq_id, np.asarray(token_ids, dtype=np.int32), max_tokens, salt, lora_id)
        if self._in_flight[ve] is not None:
            # Its scheduler awaits the batch in flight (pipelining): it takes new requests
            # after that batch's update, at the engine's next turn (_admit_deferred).
            self._deferred[ve].append((request, admit))
        else:
            try:
                self._admit(ve, admit)
            except ValueError as exc:
                del self._seqs[parent.seq_id]
                raise RequestError(ERR_CAPACITY, str(exc)) from None
        self._requests[request_id] = request
        self._ve_requests[ve] += 1
        if lora_id:
            self._request_lora[request_id] = lora_request
            self._lora_users[lora_id] = self._lora_users.get(lora_id, 0) + 1
        self._prompt_tokens_total += len(token_ids)

    def _admit(self, ve: int, admit: tuple) -> None:
        seq_id, token_ids, max_tokens, salt, lora_id = admit
        self.schedulers[ve].add_request(seq_id, token_ids, max_tokens, cache_salt=salt,
                                        lora_id=lora_id)

    def _admit_deferred(self, ve: int, touched: dict[str, Request]) -> None:
        """Hand virtual engine ve's scheduler the requests added while its batch was in flight
        (those aborted meanwhile are skipped; one the scheduler refuses fails alone --
        _check_admissible refuses the same ones first, so this does not happen)."""
        deferred, self._deferred[ve] = self._deferred[ve], []
        for request, admit in deferred:
            if request.finished:
                continue
            try:
                self._admit(ve, admit)
            except ValueError as exc:
                self._fail_requests({request.request_id: _describe("admission", exc)}, touched)

    def _prompt_token_ids(self, prompt, prompt_token_ids, messages, chat_options) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise RequestError(
                ERR_INVALID, "give exactly one of prompt, prompt_token_ids, messages"
            )
        if chat_options is not None and messages is None:
            raise RequestError(ERR_INVALID, "chat options (chat_template, add_generation_prompt, "
                                            "continue_final_message, tools, "
                                            "chat_template_kwargs) apply to messages only")
        if prompt_token_ids is not None:
            try:
                ids = [int(t) for t in prompt_token_ids]
            except (TypeError, ValueError):
                raise RequestError(ERR_INVALID, "prompt_token_ids must be a list of ints") from None
        elif self.tokenizer is None:
            raise RequestError(ERR_INVALID, "this engine has no tokenizer; send prompt_token_ids")
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError(ERR_INVALID, "prompt must be a string")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = render_chat(self.tokenizer, messages, chat_options)
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

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        params = request.params
        # Sequence j of a seeded request draws from seed + j (vLLM's ParentRequest); None:
        # the engine's stream.
        generator = make_request_generator(params.seed, index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                           params.skip_special_tokens)
        seq = Sequence(next(self._seq_ids), index, generator, detok,
                       logprobs=[] if params.logprobs is not None else None)
        request.seqs.append(seq)
        self._seqs[seq.seq_id] = (request, seq)
        return seq

    # ------------------------------------------------------------------ abort

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; the next step() returns its final output ("abort")."""
        request = self._requests.get(request_id)
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
        self._finish_request(request)
        self._pending_final.append(request)
        return True

    def _finish_request(self, request: Request) -> None:
        request.finished = True
        request.finished_time = time.monotonic()
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)
        del self._requests[request.request_id]
        self._ve_requests[request.virtual_engine] -= 1
        lora_request = self._request_lora.pop(request.request_id, None)
        if lora_request is not None:
            lora_id = lora_request.lora_int_id
            self._lora_users[lora_id] -= 1
            if not self._lora_users[lora_id]:
                del self._lora_users[lora_id]

    # ------------------------------------------------------------------ step

    def has_unfinished_requests(self) -> bool:
        return (bool(self._requests) or bool(self._pending_final)
                or any(s is not None for s in self._in_flight))

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> sample -> postprocess. Returns every delta
        (the requests aborted since the last step end here too).

        Faults are contained (docs/engine_api.md, "Failures"): an exception in one request's
        part of the step (its sampling, logprobs, detokenization, stop checks, fork) fails that
        request alone -- finish_reason "error", `RequestOutput.error` set, its blocks freed --
        and the rest of the batch goes on. One that belongs to no request (the forward, the
        scheduler) fails the step's requests, leaves the scheduler clean and returns; after
        MAX_CONSECUTIVE_STEP_FAILURES such steps in a row, or a failure whose exception says
        `engine_dead` (a lost tensor-parallel rank), the engine raises EngineDeadError.
        """
        if self.num_virtual_engines > 1:
            return self._pipelined_step()
        if self._async is not None:
            outputs = self._async.step()
            if outputs is not None:
                return outputs
        touched: dict[str, Request] = {r.request_id: r for r in self._pending_final}
        self._pending_final = []
        if self._requests:
            if self.speculator is not None:
                self._propose()
            try:
                scheduled = self.scheduler.schedule()                # SchedulerOutput
            except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
                self._reset(exc, touched)
                return self._outputs(touched)
            failed: dict[str, str] = {}  # request id -> why, for faults of one request
            try:
                draft_weights = self._run_draft(scheduled)           # None: no draft model
                batch = self._plan_sampling(scheduled, failed)       # SamplingBatch
                lora_slots = self._lora_slots(scheduled, failed)     # None: no adapters
            except Exception as exc:  # noqa: BLE001 -- belongs to no single request
                self._fail_step(scheduled, exc, touched)
            else:
                self._finish_step(scheduled, batch, failed, touched, lambda: self.runner.execute(
                    scheduled, batch.prompt_logit_rows, row_lora_slots=lora_slots),
                    draft_weights)
        return self._outputs(touched)

    def _finish_step(self, scheduled, batch: SamplingBatch, failed: dict[str, str],
                     touched: dict[str, Request], logits, draft_weights=None) -> None:
        """The step's logits (`logits()`: the runner's execute, or a pipelined step's collect),
        sampling, verification of drafts, then postprocessing; a failure of any but the last
        belongs to no single request and fails the step."""
        try:
            executed = logits()                                      # RunnerOutput
            sampled = self._sample(batch, executed, failed)          # SamplerOutput
            verified = self._verify(batch, executed, failed, draft_weights)
        except Exception as exc:  # noqa: BLE001 -- belongs to no single request
            self._fail_step(scheduled, exc, touched)
        else:
            self._postprocess(scheduled, batch, executed, sampled, failed, touched, verified)
            self._num_failed_steps = 0

    def _pipelined_step(self) -> list[RequestOutput]:
        """One iteration with pipeline parallelism, on the next virtual engine in turn: collect
        its batch in flight (sample, postprocess), then schedule and submit its next one, whose
        later stages run while this process steps the other engines. Faults are contained as
        in `step`; a request's results arrive one round (pipeline_parallel_size steps) after
        its batch was submitted."""
        touched: dict[str, Request] = {r.request_id: r for r in self._pending_final}
        self._pending_final = []
        ve = self._next_ve
        self._next_ve = (ve + 1) % self.num_virtual_engines
        self._ve = ve
        in_flight = self._in_flight[ve]
        if in_flight is not None:
            self._in_flight[ve] = None
            self._finish_step(in_flight.scheduled, in_flight.batch, in_flight.failed, touched,
                              lambda: self.runner.collect(in_flight.scheduled, in_flight.handle))
        if self._deferred[ve]:
            self._admit_deferred(ve, touched)
        if self._ve_requests[ve]:
            if self.speculator is not None:  # its sequences are up to date: collected above
                self._propose()
            try:
                scheduled = self.scheduler.schedule()
            except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
                self._reset(exc, touched)
                return self._outputs(touched)
            failed: dict[str, str] = {}
            try:
                batch = self._plan_sampling(scheduled, failed)
                handle = self.runner.submit(scheduled, batch.prompt_logit_rows,
                                            self._lora_slots(scheduled, failed), ve)
            except Exception as exc:  # noqa: BLE001 -- belongs to no single request
                self._fail_step(scheduled, exc, touched)
            else:
                self._in_flight[ve] = InFlightStep(scheduled, batch, failed, handle)
        return self._outputs(touched)

    @staticmethod
    def _outputs(touched: dict[str, Request]) -> list[RequestOutput]:
        """The step's outputs: one per touched request, as its output_kind asks (a
        FINAL_ONLY request still running has none)."""
        return take_outputs(touched.values())

    def _plan_sampling(self, out, failed: dict[str, str]) -> SamplingBatch:
        """Which sequence samples from which logits row this step: the one place where an
        n > 1 request expands (its first sample yields n sequences from one logits row; the
        siblings are made here and forked onto the parent's blocks in _postprocess), and where
        prompt-logprob rows are picked. Also records prefix-cache hits and the first scheduled
        time of new requests."""
        now = time.monotonic()
        seqs = self._seqs
        for seq_id, num_cached in zip(out.new_req_ids.tolist(),
                                      out.num_prefix_cached_tokens.tolist()):
            request, seq = seqs[seq_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if seq.index == 0 and not seq.output_token_ids and not request.num_cached_prompt_tokens:
                request.num_cached_prompt_tokens = num_cached
        # Python ints and (request, sequence) per row, converted once: this runs per row.
        row_seq_ids = out.req_ids.tolist()
        entries = [seqs[seq_id] for seq_id in row_seq_ids]
        batch = SamplingBatch(prompt_logit_rows=tuple(
            row for row, entry in enumerate(entries)
            if entry[0].prompt_logprobs is not None and self._wants_prompt_logits(
                row_seq_ids[row], int(out.num_computed_tokens_before[row]),
                int(out.query_lens[row]))))
        sample_rows = np.flatnonzero(out.sample_mask)  # RunnerOutput.sample_rows
        num_drafts = None  # per row, only when some row verifies drafts
        logits_start = range(sample_rows.size)  # RunnerOutput.logits_start, if any
        if out.total_draft_tokens:
            num_drafts = out.num_draft_tokens.tolist()
            logits_start = (np.cumsum(out.num_draft_tokens[sample_rows] + 1) - (
                out.num_draft_tokens[sample_rows] + 1)).tolist()
        targets, row_index = batch.targets, batch.row_index
        for row, start in zip(sample_rows.tolist(), logits_start):
            request, seq = entries[row]
            if num_drafts is not None and num_drafts[row]:
                # Verifies its drafts: the query tokens after its last token.
                num_draft = num_drafts[row]
                first = int(out.query_start_loc[row]) + 1
                batch.spec.append(SpecRow(row, seq, request, start,
                                          out.input_token_ids[first:first + num_draft]))
                continue
            if request.params.n <= 1 or request.forked:  # one sequence samples from the row
                targets.append((row, seq, request))
                row_index.append(start)
                continue
            request.forked = True
            try:
                siblings = [self._new_sequence(request, k) for k in range(1, request.params.n)]
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed[request.request_id] = _describe("expanding n > 1", exc)
                continue
            batch.forks.append((seq, siblings))
            for s in [seq, *siblings]:
                targets.append((row, s, request))
                row_index.append(start)
        return batch

    # ------------------------------------------------------------------ speculative decoding

    def _propose(self) -> None:
        """Drafts for the next schedule(); a proposer failure costs this step its drafts only."""
        try:
            self.speculator.propose(self.scheduler, self._max_draft)
        except Exception as exc:  # noqa: BLE001 -- belongs to no request: plain decoding
            log.error("speculative proposal failed, decoding without drafts: %s",
                      _describe("proposing", exc), exc_info=exc)

    def _max_draft(self, seq_id: int) -> int:
        """How many drafts this sequence may verify in one step: what it may still emit
        after the step's final token; none when its logprobs are asked in a processed mode
        (the verification weights are not those values), when its next sample is an n > 1
        request's first (which forks the siblings) or when it is unknown (finished)."""
        entry = self._seqs.get(seq_id)
        if entry is None:
            return 0
        request, seq = entry
        params = request.params
        if params.n > 1 and not request.forked:
            return 0  # its first sample forks the siblings: a plain row
        if params.logprobs is not None and not self.config.logprobs_mode.startswith("raw"):
            return 0
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len
        return max_new - len(seq.output_token_ids) - 1

    def _run_draft(self, out) -> dict[int, np.ndarray] | None:
        """The draft model's part of the step (draft_model.py): its KV for every scheduled
        token, and the drafts of the speculating rows written into `out`. Returns batch row ->
        the draft's weights q of its drafts."""
        if self.speculator is None or self.speculator.draft is None:
            return None
        histories = {}
        for row in np.flatnonzero(out.num_draft_tokens).tolist():
            request, seq = self._seqs[int(out.req_ids[row])]
            histories[row] = (request.params, request.prompt_token_ids, seq.output_token_ids,
                              seq.generator)
        return self.speculator.draft.run(out, histories, self.sampler.generator)

    def _verify(self, batch: SamplingBatch, executed: RunnerOutput,
                failed: dict[str, str],
                draft_weights: dict[int, np.ndarray] | None = None) -> VerifiedRows:
        """The spec rows' emitted tokens. If the batch fails, each request's rows are
        verified alone so the one at fault is found (and failed), as in _sample."""
        rows = batch.spec
        verified = VerifiedRows([[] for _ in rows], [None] * len(rows), [0] * len(rows))
        if not rows:
            return verified
        logits = executed.logits
        # Host rows of every spec row's positions, in batch order.
        index = np.concatenate([np.arange(r.logits_start, r.logits_start + r.draft_token_ids.size
                                          + 1) for r in rows])
        host = np.asarray(self.backend.to_host(logits[index]) if self.backend.logits_on_device
                          else logits[index], dtype=np.float32)
        offsets = np.concatenate(([0], np.cumsum([r.draft_token_ids.size + 1 for r in rows])))
        groups = {None: list(range(len(rows)))}
        while groups:
            retry: dict[str, list[int]] = {}
            for request_id, own in groups.items():
                own = [j for j in own if rows[j].request.request_id not in failed]
                if not own:
                    continue
                try:
                    part = self.speculator.verify(
                        np.concatenate([host[offsets[j]:offsets[j + 1]] for j in own]),
                        [rows[j] for j in own], self.sampler.generator, draft_weights)
                    for b, j in enumerate(own):
                        tokens = part.emitted(b).tolist()
                        verified.tokens[j] = tokens
                        verified.num_accepted[j] = len(tokens) - 1
                        num_top = rows[j].request.params.logprobs
                        if num_top is not None:
                            verified.logprobs[j] = [
                                self.speculator.logprobs(host[offsets[j] + i], t, num_top)
                                for i, t in enumerate(tokens)]
                except Exception as exc:  # noqa: BLE001
                    if request_id is None:
                        for j in own:
                            retry.setdefault(rows[j].request.request_id, []).append(j)
                    else:
                        failed[request_id] = _describe("verifying drafts", exc)
                    continue
            groups = retry
        self.speculator.record([r.seq.seq_id for r in rows],
                               [r.draft_token_ids.size for r in rows], verified.num_accepted)
        return verified

    def _sample(self, batch: SamplingBatch, executed: RunnerOutput,
                failed: dict[str, str]) -> SamplerOutput:
        """One token per sampling row, by the backend's sampler, where the logits are. If the
        batch fails, each request's rows are sampled alone so the one at fault is found (and
        failed); the others get their tokens. Failed rows get token -1 and no logprobs."""
        token_ids = np.full(len(batch.targets), -1, np.int32)
        logprobs: list = [None] * len(batch.targets)
        rows = [j for j, t in enumerate(batch.targets) if t[2].request_id not in failed]
        groups = {None: rows} if rows else {}  # one batch first; per request if it fails
        while groups:
            retry: dict[str, list[int]] = {}
            for request_id, own in groups.items():
                try:
                    part = self._sample_rows(batch, executed, own)
                except Exception as exc:  # noqa: BLE001
                    if request_id is None:  # find the request it belongs to
                        for j in own:
                            retry.setdefault(batch.targets[j][2].request_id, []).append(j)
                    else:  # this request's fault only
                        failed[request_id] = _describe("sampling", exc)
                    continue
                token_ids[own] = part.token_ids
                for j, lp in zip(own, part.logprobs):
                    logprobs[j] = lp
            groups = retry
        return SamplerOutput(token_ids, logprobs)

    def _sample_rows(self, batch: SamplingBatch, executed: RunnerOutput,
                     rows: list[int]) -> SamplerOutput:
        """The sampler over the sampling rows `rows` (indices into batch.targets)."""
        targets = [batch.targets[j] for j in rows]
        return self.sampler.sample(
            executed.logits, [t[2].params for t in targets], [t[1].generator for t in targets],
            [t[2].prompt_token_ids for t in targets], [t[1].output_token_ids for t in targets],
            row_index=[batch.row_index[j] for j in rows])

    def _postprocess(self, out, batch: SamplingBatch, executed: RunnerOutput,
                     sampled: SamplerOutput, failed: dict[str, str],
                     touched: dict[str, Request], verified: VerifiedRows | None = None) -> None:
        """Prompt logprobs; append, detokenize and stop-check every new token; fail the
        requests at fault; tell the scheduler (finished blocks are freed at once); fork the
        siblings of n > 1 requests; finish the requests whose every sequence has finished."""
        req_ids = out.req_ids
        for row, logits in executed.prompt_logits.items():
            seq_id = int(req_ids[row])
            entry = self._seqs.get(seq_id)
            if entry is None:  # aborted while its batch was in flight (pipelining)
                continue
            request = entry[0]
            try:
                self._add_prompt_logprobs(seq_id, int(out.num_computed_tokens_before[row]),
                                          logits)
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed.setdefault(request.request_id, _describe("prompt logprobs", exc))
        ended, stopped, complete, emitted = self._append_sampled(batch, sampled, verified,
                                                                 failed, touched)
        self._fail_requests(failed, touched)  # aborted now: update_from_output skips their rows
        num_reqs = out.num_reqs
        if complete and not batch.forks and not batch.spec and len(batch.targets) == num_reqs:
            # Every row sampled one token for its own sequence, in row order: the sampler's
            # tokens are the rows' tokens and only the rows that ended stop.
            token_ids = sampled.token_ids
            stop_mask = np.zeros(num_reqs, dtype=bool)
            stop_mask[stopped] = True
        else:
            token_ids, stop_mask = self._scheduler_rows(req_ids, batch)
        num_accepted, accepted = None, []
        if batch.spec:
            num_accepted = np.zeros(num_reqs, dtype=np.int32)
            for spec, tokens in zip(batch.spec, emitted):
                if not tokens:
                    continue  # failed before its first token: the scheduler skips the row
                token_ids[spec.row] = tokens[-1]
                num_accepted[spec.row] = len(tokens) - 1
                accepted += tokens[:-1]
                stop_mask[spec.row] = spec.seq.finished
        try:
            finished_ids = self.scheduler.update_from_output(
                out, token_ids, stop_mask, num_accepted,
                np.array(accepted, dtype=np.int32) if accepted else None)
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            self._reset(exc, touched)
            return
        for parent, siblings in batch.forks:
            request = self._seqs.get(parent.seq_id, (None,))[0]
            if request is None or request.finished:
                continue
            try:
                for sib in siblings:
                    if not sib.finished:
                        self.scheduler.fork_request(parent.seq_id, sib.seq_id,
                                                    sib.output_token_ids[-1])
                if parent.finished and any(not s.finished for s in siblings):
                    self.scheduler.abort_request(parent.seq_id)  # kept only to fork from
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                self._fail_requests({request.request_id: _describe("forking", exc)}, touched)
        for seq_id in finished_ids:
            entry = self._seqs.get(int(seq_id))
            if entry is not None and not entry[1].finished:
                # The scheduler's length limit fired where ours did not; both count the same
                # tokens, so this is a defect, but the request must still end cleanly.
                log.error("scheduler finished sequence %d before the engine did", seq_id)
                entry[1].finish_reason = FINISH_LENGTH
                ended[entry[0].request_id] = entry[0]
        # Only a request with a sequence that ended in this step can have just finished (the
        # others' last sequence ended earlier, when it finished, or never did).
        for request in ended.values():
            if not request.finished and all(s.finished for s in request.seqs) and (
                    len(request.seqs) == request.params.n):
                self._finish_request(request)

    def _append_sampled(self, batch: SamplingBatch, sampled: SamplerOutput,
                        verified: VerifiedRows | None, failed: dict[str, str],
                        touched: dict[str, Request]) -> tuple[dict[str, Request], list[int],
                                                              bool, list[list[int]]]:
        """Append every token of the step to its sequence and check its stops: the sampled
        rows, then the spec rows' tokens one at a time, up to the first that ends the sequence
        (so a stop is never overshot). A token of a request without stop strings that neither
        reaches the length limit nor is a stop token id (Request.token_stops) is only appended:
        check_token_stop would answer None; every other token takes _append_token.

        Returns (ended: the requests with a sequence that ended, stopped: the indices into
        batch.targets of the sequences that ended, complete: every target got its token,
        emitted: per spec row, the tokens the scheduler appends)."""
        now = time.monotonic()
        sampled_ids = sampled.token_ids.tolist()  # Python ints, one conversion per step
        append_token = self._append_token
        ended: dict[str, Request] = {}
        stopped: list[int] = []
        complete = True
        num_appended = 0  # tokens appended here without _append_token (which counts its own)
        for j, (_, seq, request) in enumerate(batch.targets):
            request_id = request.request_id
            if request.finished or (failed and request_id in failed):  # finished: aborted
                complete = False                                       # in flight
                continue
            token = sampled_ids[j]
            try:
                if seq.logprobs is not None:
                    entry = sampled.logprobs[j]  # TokenLogprobs
                    seq.logprobs.append(position_logprobs(entry, self._token_texts))
                    seq.cumulative_logprob += entry.logprob
                stops = request.token_stops
                if stops is None:
                    stops = request.token_stops = self._token_stops(request)
                output_token_ids = seq.output_token_ids
                if (stops and seq.finish_reason is None and len(output_token_ids) + 1 < stops[0]
                        and token not in stops[1]):
                    output_token_ids.append(token)
                    num_appended += 1
                else:
                    append_token(request, seq, token)
                    if seq.finish_reason is not None:
                        stopped.append(j)
                        ended[request_id] = request
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed[request_id] = _describe("postprocessing a token", exc)
                complete = False
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request_id] = request
        self._generation_tokens_total += num_appended
        emitted: list[list[int]] = []
        for j, spec in enumerate(batch.spec):
            request, seq = spec.request, spec.seq
            emitted.append([])
            if request.request_id in failed:
                continue
            try:
                for i, token in enumerate(verified.tokens[j]):
                    if verified.logprobs[j] is not None:
                        entry = verified.logprobs[j][i]
                        seq.logprobs.append(position_logprobs(entry, self._token_texts))
                        seq.cumulative_logprob += entry.logprob
                    self._append_token(request, seq, int(token))
                    emitted[j].append(int(token))
                    if seq.finished:
                        ended[request.request_id] = request
                        break
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed[request.request_id] = _describe("postprocessing a token", exc)
                continue
            touched[request.request_id] = request
        return ended, stopped, complete, emitted

    def _token_stops(self, request: Request) -> tuple[int, frozenset[int]] | bool:
        """Request.token_stops: False (every token takes _append_token) for a request whose
        text the engine decodes as it goes, else its stop_checker.token_stop_bounds."""
        if needs_text(request.params):
            return False
        return token_stop_bounds(request.params, len(request.prompt_token_ids),
                                 self.eos_token_ids, self.max_model_len)

    def _scheduler_rows(self, req_ids: np.ndarray,
                        batch: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
        """Each scheduler row's sampled token and stop flag, from its sequence (rows that did
        not sample, and those of failed requests, get 0 and no stop; the scheduler skips the
        latter). An n > 1 parent that stops on its first token while a sibling lives stays
        running until the siblings are forked from it. Built as lists (a numpy element write
        costs more than the rest of the row)."""
        row_seq_ids = req_ids.tolist()
        row_tokens = [0] * len(row_seq_ids)
        row_stops = [False] * len(row_seq_ids)
        siblings_of = {id(parent): sibs for parent, sibs in batch.forks}
        for row, seq, request in batch.targets:
            if seq.seq_id != row_seq_ids[row] or request.finished:
                continue  # a sibling (not a scheduler row yet), or failed
            row_tokens[row] = seq.output_token_ids[-1]
            if seq.finish_reason is not None:
                row_stops[row] = not (siblings_of and any(
                    not s.finished for s in siblings_of.get(id(seq), ())))
        return np.array(row_tokens, dtype=np.int32), np.array(row_stops, dtype=bool)

    # ------------------------------------------------------------------ failures

    def _fail_requests(self, failed: dict[str, str], touched: dict[str, Request]) -> None:
        """End each request in `failed` with finish_reason "error" and its message; every
        block it holds returns to the pool now (the scheduler skips its rows from here on)."""
        for request_id, message in failed.items():
            request = self._requests.get(request_id)
            if request is None or request.finished:
                continue
            log.error("request %s failed: %s", request_id, message)
            scheduler = self.schedulers[request.virtual_engine]
            for seq in request.seqs:
                scheduler.abort_request(seq.seq_id)  # False for unforked siblings: fine
                if not seq.finished:
                    seq.finish_reason = FINISH_ERROR
            request.error = message
            self._finish_request(request)
            touched[request_id] = request

    def _fail_step(self, out, exc: BaseException, touched: dict[str, Request]) -> None:
        """A step failed outside any one request (the forward, a kernel, memory): fail every
        request it scheduled -- and those it swapped out, whose host copy may not have been
        written -- then close the step in the scheduler with no row left to advance."""
        message = _describe("step", exc)
        log.error("engine step failed: %s", message, exc_info=exc)
        seq_ids = [int(i) for i in out.req_ids]
        if len(out.swap_out):
            seq_ids += [int(i) for i in out.preempted_ids]
        failed = {self._seqs[i][0].request_id: message for i in seq_ids if i in self._seqs}
        self._fail_requests(failed, touched)
        try:  # every row is aborted: this only ends the scheduler's step
            self.scheduler.update_from_output(out, np.zeros(out.num_reqs, np.int32),
                                              np.ones(out.num_reqs, bool))
        except Exception as reset_exc:  # noqa: BLE001
            self._reset(reset_exc, touched)
        self._num_failed_steps += 1
        if getattr(exc, "engine_dead", False):
            raise exc
        if self._num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self._num_failed_steps} steps in a row failed; last: "
                                  f"{message}") from exc

    def _reset(self, exc: BaseException, touched: dict[str, Request]) -> None:
        """The scheduler failed: fail every live request of its virtual engine and start a
        fresh scheduler (empty pool and prefix cache; the runner and its KV memory are kept)."""
        from pagedrun.pyx.scheduler import Scheduler

        message = _describe("scheduler", exc)
        log.error("engine reset: %s", message, exc_info=exc)
        ve = self._ve
        self.scheduler = Scheduler(self.scheduler.config)
        failed = {rid: message for rid, r in list(self._requests.items())
                  if r.virtual_engine == ve}
        for request_id in failed:  # the new scheduler knows none of their sequences
            request = self._requests[request_id]
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish_reason = FINISH_ERROR
            request.error = message
            self._finish_request(request)
            touched[request_id] = request

    def _wants_prompt_logits(self, seq_id: int, num_computed_before: int, query_len: int) -> bool:
        """Whether this row's chunk holds the next prompt position still missing a logprob.

        Row j of a chunk starting at position p predicts prompt token p + j + 1. Chunks after a
        recompute preemption need not line up with the first pass, so overlap is what counts.
        """
        request, seq = self._seqs[seq_id]
        if request.prompt_logprobs is None or seq.index != 0:
            return False
        need = len(request.prompt_logprobs)  # the next prompt token without a logprob
        return (need < len(request.prompt_token_ids)
                and num_computed_before + 1 <= need <= num_computed_before + query_len)

    def _add_prompt_logprobs(self, seq_id: int, num_computed_before: int,
                             logits: np.ndarray) -> None:
        """logits[j] (position num_computed_before + j) predicts the prompt token at +1."""
        request, _ = self._seqs[seq_id]
        prompt = request.prompt_token_ids
        first = len(request.prompt_logprobs)
        last = min(num_computed_before + logits.shape[0], len(prompt) - 1)  # inclusive
        if last < first:
            return
        # Prompt logprobs come from the raw logits whatever logprobs_mode says (vLLM's too).
        rows = log_softmax(logits[first - 1 - num_computed_before:last - num_computed_before])
        num_top = request.params.prompt_logprobs
        request.prompt_logprobs.extend(
            position_logprobs(token_logprobs(row, token, num_top), self._token_texts)
            for row, token in zip(rows, prompt[first:last + 1]))

    def _append_token(self, request: Request, seq: Sequence, token: int) -> None:
        """Append one sampled token: the token stop checks first (they decide whether its
        text is shown), then detokenization, then the stop strings on the new text
        (runtime/stop_checker.py has the rules and their order). Without stop strings nothing
        here reads the text: it is left to whoever reads the outputs (request.py), and only
        where it ends is recorded."""
        params = request.params
        output_token_ids = seq.output_token_ids
        output_token_ids.append(token)
        self._generation_tokens_total += 1
        num_output = len(output_token_ids)
        stop = check_token_stop(params, token, num_output,
                                len(request.prompt_token_ids) + num_output, self.eos_token_ids,
                                self.max_model_len)
        if stop is None:
            seq.finish_reason = seq.stop_reason = None
        else:
            seq.finish_reason, seq.stop_reason = stop
        detokenizer = seq.detokenizer
        if detokenizer is None:
            return
        shows_token = (stop is None or stop[0] != FINISH_STOP
                       or params.include_stop_str_in_output)
        if not needs_text(params):
            if stop is not None:  # its text: the tokens up to here (or before), then finish()
                seq.final_text_tokens = num_output if shows_token else num_output - 1
            return
        text_before = len(seq.text)
        if shows_token:
            seq.text += detokenizer.add_token(token)
        if stop is not None:  # bytes held for earlier tokens (never the skipped stop token's)
            seq.text += detokenizer.finish()
        if num_output <= params.min_tokens:
            return
        hit = find_stop_string(seq.text, len(seq.text) - text_before, params.stop,
                               params.include_stop_str_in_output)
        if hit is not None:
            seq.finish_reason, seq.stop_reason = FINISH_STOP, hit[0]
            seq.text = seq.text[:hit[1]]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (one device: nothing to do). Idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

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
            "generation_tokens_total": self._generation_tokens_total,
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict:
        """vLLM's spec_decode counters (empty when speculation is off)."""
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {"spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens}
