"""LLMEngine: add_request / abort_request / step() = schedule -> execute -> sample -> postprocess.

The seam (docs/engine_api.md): string request ids, SamplingParams in, RequestOutput deltas out.
Inside, each of a request's n sequences is one scheduler request (an int id). A step:
  1. `scheduler.schedule()` hands out the token budget and emits a SchedulerOutput;
  2. `runner.execute()` moves blocks (swap, copy-on-write), runs the forward over every scheduled
     token and returns logits of the rows that sample (plus prompt-logprob rows);
  3. the sampler draws one token per sampling sequence (n tokens from the parent's first logits
     row of an n > 1 request, one per sibling, each with its own generator);
  4. postprocess: append, detokenize, check stops (so a stop string ends the request in the step
     that completes it), tell the scheduler (`update_from_output` frees finished blocks at once),
     fork the siblings of n > 1 requests onto the parent's blocks, and return the deltas.
KV capacity is fixed at construction and logged; requests that can never run are rejected at
admission with a RequestError, never discovered mid-flight.
"""
from __future__ import annotations

import itertools
import logging
import math
import time

import numpy as np

from pagedrun.runtime.backends.base import make_backend
from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.kernels.kernel_args import array_module
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.model_runner import ModelRunner, kv_bytes_per_block
from pagedrun.runtime.outputs import Logprob, RequestOutput
from pagedrun.runtime.request import Request, Sequence
from pagedrun.runtime.sampler import _top_logprobs, log_softmax, make_request_generator
from pagedrun.runtime.sampling_params import SamplingParams, SamplingParamsError
from pagedrun.runtime.stop_checker import FINISH_ABORT, FINISH_LENGTH, check_stop
from pagedrun.runtime.weights import ModelWeights

log = logging.getLogger("pagedrun.engine")

# max_model_len when the user names none: the model's max_position_embeddings, capped, because
# a 128k default would make "one request at max length" (the capacity check) meaningless on CPU.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# KV memory budget of the cpu backend when neither num_kv_blocks nor kv_cache_memory_bytes is
# given. numpy maps pool pages lazily, so an unused budget costs address space, not memory.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# Error codes of RequestError (docs/engine_api.md).
ERR_INVALID = "invalid_request"
ERR_TOO_LONG = "prompt_too_long"
ERR_EMPTY = "empty_prompt"
ERR_DUPLICATE = "duplicate_request_id"
ERR_CAPACITY = "capacity"


class RequestError(PagedRunError):
    """A request was refused at admission; nothing of it was admitted."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DeviceNotAvailableError(PagedRunError, NotImplementedError):
    """The asked-for device's backend does not exist (yet) or sees no device."""


def resolve_device(device: str) -> str:
    """"auto": cuda when CuPy sees a GPU, else cpu. "sim" runs the CUDA kernels on the CPU
    harness; "cuda" without a usable GPU raises DeviceNotAvailableError."""
    if device in ("cpu", "sim"):
        return device
    if device == "auto":
        return "cuda" if _cuda_backend_usable() else "cpu"
    if device == "cuda" and _cuda_backend_usable():
        return "cuda"
    raise DeviceNotAvailableError(
        f"device {device!r}: CuPy is not installed or sees no GPU; use device='cpu' (numpy) "
        "or 'sim' (the CUDA kernels on the CPU harness)")


def _cuda_backend_usable() -> bool:
    from pagedrun.runtime.backends.cuda_backend import cuda_available

    return cuda_available()


def make_logprobs(logits: np.ndarray, token_ids: np.ndarray, num_top: int) -> list[Logprob]:
    """Logprob (chosen + top `num_top`) of each row. logits: [rows, vocab]; token_ids: [rows]."""
    lp = log_softmax(logits)
    return [Logprob(int(token), float(lp[row, token]), _top_logprobs(lp[row], num_top))
            for row, token in enumerate(token_ids)]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 weights: ModelWeights | None = None, tokenizer=None) -> None:
        """Load the model (or take an in-memory one), size the KV pools, start the scheduler.

        `model_config` + `weights` (+ optional `tokenizer`) bypass loading `config.model`; tests
        use this. Without a tokenizer, prompts must be token ids and stop strings are refused.
        """
        from pagedrun.pyx.scheduler import Scheduler, SchedulerConfig

        self.config = config
        self.device = resolve_device(config.device)
        if self.device == "cpu" and config.dtype == "float16":
            # numpy's float16 GEMMs are slow: the cpu backend computes float16 in float32
            # ("bfloat16" selects the bf16-weight backend, runtime/backends/cpu_bf16_backend.py).
            log.warning("dtype %s: the cpu backend runs float32", config.dtype)
        self.model_name = config.model or "default"
        if model_config is None:
            model_config, weights, tokenizer = _load_model(config.model,
                                                           config.tensor_parallel_size == 1)
        elif config.tensor_parallel_size > 1:
            raise PagedRunError("tensor parallel ranks read their shards from a model directory; "
                                "give EngineConfig.model instead of in-memory weights")
        if config.tensor_parallel_size > 1:  # refuse what cannot shard before anything starts
            from pagedrun.runtime.distributed.sharding import check_shardable

            check_shardable(model_config, config.tensor_parallel_size)
            if self.device == "cuda" and config.num_kv_blocks is None \
                    and config.kv_cache_memory_bytes is None:
                # measure_kv_budget runs the whole model on one GPU; per-rank measurement
                # (each rank's shard, the minimum over ranks) is not wired yet (2026-11-29).
                raise PagedRunError("tensor parallel on cuda: give num_kv_blocks "
                                    "(--num-kv-blocks) or kv_cache_memory_bytes, per rank")
        self.model_config = model_config
        self.backend = make_backend(self.device, config.dtype)  # the one place that picks ops
        if self.device != "cpu":  # unsupported kernel shapes fail here, not mid-step
            self.backend.check_model(model_config.head_dim, config.block_size)
        self.tokenizer = tokenizer
        self.max_model_len = self._resolve_max_model_len()
        self.block_size = config.block_size
        self.bytes_per_block = kv_bytes_per_block(_kv_config(model_config, config),
                                                  config.block_size,
                                                  self.backend.kv_dtype)
        self.num_kv_blocks = self._resolve_num_kv_blocks(weights)
        self.num_cpu_blocks = (config.swap_space_bytes // self.bytes_per_block
                               if config.preemption_mode == "swap" else 0)
        # The model's EOS ids plus the tokenizer's (chat models end turns with the latter).
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            frozenset() if tokenizer_eos is None else frozenset([tokenizer_eos]))
        if config.tensor_parallel_size > 1:
            from pagedrun.runtime.distributed.executor import start_tensor_parallel

            self.runner = start_tensor_parallel(self, model_config)
        else:
            self.runner = ModelRunner(model_config, weights, block_size=self.block_size,
                                      num_gpu_blocks=self.num_kv_blocks,
                                      num_cpu_blocks=self.num_cpu_blocks,
                                      max_model_len=self.max_model_len, ops=self.backend,
                                      # the kernel sampler reads logits where they are
                                      logits_on_device=self.device != "cpu")
        self.scheduler = Scheduler(SchedulerConfig(
            num_gpu_blocks=self.num_kv_blocks, block_size=self.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks, preemption_mode=config.preemption_mode,
            check_invariants=config.check_invariants))
        # cpu: the numpy sampler; sim / cuda: the sampling kernels, same draws per seed.
        self.sampler = self.backend.sampler(sorted(self.eos_token_ids), seed=config.seed)
        self._seq_ids = itertools.count(1)
        # Salts that keep prompt-logprob requests out of the prefix cache (every prompt position
        # must be computed to have its logits); 0 is everyone else's shared salt.
        self._salts = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self._pending_final: list[Request] = []  # aborted since the last step
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        info = self.model_info()
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/block); "
                 "max_model_len %d -> max concurrency at max length %.2f; device %s",
                 self.num_kv_blocks, self.block_size, info["kv_capacity_tokens"],
                 self.num_kv_blocks * self.bytes_per_block / 2**20, self.bytes_per_block,
                 self.max_model_len, info["max_concurrency_at_max_len"], self.device)

    # ------------------------------------------------------------------ capacity

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            max_len = min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
        else:
            max_len = self.config.max_model_len
            if not 1 <= max_len <= model_max:
                raise PagedRunError(f"max_model_len: must be in [1, {model_max}] "
                                    f"(max_position_embeddings), got {max_len}")
        window = self.model_config.sliding_window
        if window is not None and max_len > window:
            # The attention ops have no window: within it, full attention is exact.
            log.warning("max_model_len %d capped to the sliding window %d", max_len, window)
            max_len = window
        return max_len

    def _resolve_num_kv_blocks(self, weights) -> int:
        if self.config.num_kv_blocks is not None:
            if self.config.num_kv_blocks < 1:
                raise PagedRunError(f"num_kv_blocks: must be >= 1, got {self.config.num_kv_blocks}")
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device == "cuda":
            # gpu_memory_utilization x total - weights - the peak of a maximum-size step
            budget = self.backend.measure_kv_budget(
                self.model_config, weights, block_size=self.block_size,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                gpu_memory_utilization=self.config.gpu_memory_utilization)
        elif budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # Never more than every sequence at max length could use.
        useful = self.config.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        num = min(budget // self.bytes_per_block, useful)
        if num < 1:
            raise PagedRunError(f"KV budget {budget} bytes holds no {self.bytes_per_block}-byte block")
        return int(num)

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
        }

    # ------------------------------------------------------------------ admission

    def add_request(self, request_id: str, *, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, messages: list[dict] | None = None,
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Admit a request or raise RequestError (then nothing of it was admitted)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(ERR_INVALID, "request_id must be a non-empty string")
        if request_id in self._requests:
            raise RequestError(ERR_DUPLICATE, f"request id {request_id!r} is already running")
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise RequestError(ERR_INVALID, str(exc)) from None
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids, messages)
        self._check_admissible(token_ids, params)

        request = Request(request_id, token_ids, params,
                          arrival_time if arrival_time is not None else time.monotonic())
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # token 0 has no context
        parent = self._new_sequence(request, 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        salt = next(self._salts) if params.prompt_logprobs is not None else 0
        try:
            self.scheduler.add_request(parent.seq_id, np.asarray(token_ids, dtype=np.int32),
                                       max_tokens, cache_salt=salt)
        except ValueError as exc:
            del self._seqs[parent.seq_id]
            raise RequestError(ERR_CAPACITY, str(exc)) from None
        self._requests[request_id] = request
        self._prompt_tokens_total += len(token_ids)

    def _prompt_token_ids(self, prompt, prompt_token_ids, messages) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise RequestError(ERR_INVALID, "give exactly one of prompt, prompt_token_ids, messages")
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
            try:
                ids = list(self.tokenizer.apply_chat_template(messages, tokenize=True))
            except Exception as exc:  # template errors are the user's messages' fault
                raise RequestError(ERR_INVALID, f"chat template: {exc}") from None
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
        if params.stop and self.tokenizer is None:
            raise RequestError(ERR_INVALID, "stop strings need a tokenizer; use stop_token_ids")
        # The KV a sequence may need at its longest (the scheduler's rule: prompt + max_tokens,
        # counting the last token's slot, so both refuse exactly the same requests).
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len
        longest = min(prompt_len + max_new, self.max_model_len)
        blocks = math.ceil(longest / self.block_size)
        if blocks > self.num_kv_blocks:
            raise RequestError(ERR_CAPACITY, f"needs {blocks} KV blocks ({longest} tokens) but the "
                                             f"whole pool has {self.num_kv_blocks}")

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        params = request.params
        generator = make_request_generator(params.seed, index)  # None: the engine's stream
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
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.abort_request(seq.seq_id)
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

    # ------------------------------------------------------------------ step

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_final)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, sample, postprocess. Returns every delta."""
        touched: dict[str, Request] = {r.request_id: r for r in self._pending_final}
        self._pending_final = []
        if self._requests:
            self._run_step(touched)
        return [r.take_delta() for r in touched.values()]

    def _run_step(self, touched: dict[str, Request]) -> None:
        out = self.scheduler.schedule()
        for seq_id, num_cached in zip(out.new_req_ids, out.num_prefix_cached_tokens):
            request, seq = self._seqs[int(seq_id)]
            if seq.index == 0 and not seq.output_token_ids and not request.num_cached_prompt_tokens:
                request.num_cached_prompt_tokens = int(num_cached)
        req_ids = out.req_ids
        prompt_rows = tuple(row for row in range(out.num_reqs) if self._wants_prompt_logits(
            int(req_ids[row]), int(out.num_computed_tokens_before[row]), int(out.query_lens[row])))
        runner_out = self.runner.execute(out, prompt_rows)
        for row, logits in runner_out.prompt_logits.items():
            self._add_prompt_logprobs(int(req_ids[row]), int(out.num_computed_tokens_before[row]),
                                      logits)

        sampled = np.zeros(out.num_reqs, dtype=np.int32)
        stop_mask = np.zeros(out.num_reqs, dtype=bool)
        forks = self._sample(out, runner_out, sampled, stop_mask, touched)
        finished_ids = self.scheduler.update_from_output(out, sampled, stop_mask)
        for parent, siblings, stop_parent in forks:
            for sib in siblings:
                if not sib.finished:
                    self.scheduler.fork_request(parent.seq_id, sib.seq_id, sib.output_token_ids[-1])
            if stop_parent:
                self.scheduler.abort_request(parent.seq_id)
        for seq_id in finished_ids:
            entry = self._seqs.get(int(seq_id))
            if entry is not None and not entry[1].finished:
                # The scheduler's length limit fired where ours did not; both count the same
                # tokens, so this is a defect, but the request must still end cleanly.
                log.error("scheduler finished sequence %d before the engine did", seq_id)
                entry[1].finish_reason = FINISH_LENGTH
        for request in touched.values():
            if not request.finished and all(s.finished for s in request.seqs) and (
                    len(request.seqs) == request.params.n):
                self._finish_request(request)

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
        rows = logits[first - 1 - num_computed_before:last - num_computed_before]
        request.prompt_logprobs.extend(
            make_logprobs(rows, np.asarray(prompt[first:last + 1]), request.params.prompt_logprobs))

    def _sample(self, out, runner_out, sampled: np.ndarray, stop_mask: np.ndarray,
                touched: dict[str, Request]) -> list:
        """Sample every sampling row, postprocess each new token; returns the forks to make."""
        rows = runner_out.sample_rows
        if rows.size == 0:
            return []
        # Expand: the first sample of an n > 1 parent yields n sequences from one logits row.
        logit_rows, targets = [], []  # targets: (batch row, sequence, request)
        forks = []
        for i, row in enumerate(rows):
            request, seq = self._seqs[int(out.req_ids[row])]
            if request.params.n > 1 and not request.forked:
                request.forked = True
                siblings = [self._new_sequence(request, k) for k in range(1, request.params.n)]
                forks.append((seq, siblings))
                for s in [seq, *siblings]:
                    logit_rows.append(i)
                    targets.append((row, s, request))
            else:
                logit_rows.append(i)
                targets.append((row, seq, request))
        logits = runner_out.logits
        if len(logit_rows) != logits.shape[0]:  # numpy, or the backend's array (cupy)
            logits = logits[array_module(logits).asarray(logit_rows)]
        sampler_out = self.sampler.sample(
            logits, [t[2].params for t in targets], [t[1].generator for t in targets],
            [t[2].prompt_token_ids for t in targets], [t[1].output_token_ids for t in targets])
        now = time.monotonic()
        for j, (row, seq, request) in enumerate(targets):
            token = int(sampler_out.token_ids[j])
            if seq.logprobs is not None:
                seq.logprobs.append(sampler_out.logprobs[j])
            self._append_token(request, seq, token)
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request.request_id] = request
        # Scheduler rows: sampled token and stop flag. An n > 1 parent that stops on its first
        # token while a sibling lives stays running until the siblings are forked from it.
        result = []
        fork_parents = {id(p): sibs for p, sibs in forks}
        for row, seq, request in targets:
            if seq.seq_id != int(out.req_ids[row]):
                continue  # a sibling: not a scheduler row yet
            sampled[row] = seq.output_token_ids[-1]
            if id(seq) in fork_parents:
                sibs = fork_parents[id(seq)]
                live_sibs = any(not s.finished for s in sibs)
                stop_mask[row] = seq.finished and not live_sibs
                result.append((seq, sibs, seq.finished and live_sibs))
            else:
                stop_mask[row] = seq.finished
        return result

    def _append_token(self, request: Request, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        self._generation_tokens_total += 1
        num_new_chars = 0
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add_token(token)
            seq.text += delta
            num_new_chars = len(delta)
        decision = check_stop(request.params, token, len(seq.output_token_ids),
                              len(request.prompt_token_ids) + len(seq.output_token_ids),
                              seq.text, num_new_chars, self.eos_token_ids, self.max_model_len)
        if decision.finish_reason is None:
            return
        seq.finish_reason = decision.finish_reason
        seq.stop_reason = decision.stop_reason
        if decision.text_end is not None:
            seq.text = seq.text[:decision.text_end]
        elif seq.detokenizer is not None:
            seq.text += seq.detokenizer.finish()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (one device: nothing to do). Idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> dict:
        s = self.scheduler.get_stats()
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
        }


def resolve_model_dir(model: str | None) -> str:
    """The HF directory of `model`: itself, a .gguf's converted cache, or the default model."""
    from pagedrun.runtime.default_model import default_model_dir, ensure_converted
    from pagedrun.runtime.paths import models_cache_dir

    if model is None:
        return default_model_dir()
    if str(model).endswith(".gguf"):
        return ensure_converted(model, models_cache_dir())
    return model


def _kv_config(model_config: ModelConfig, config: EngineConfig) -> ModelConfig:
    """The config whose KV heads one device holds (tensor parallel: a rank's)."""
    if config.tensor_parallel_size == 1:
        return model_config
    from pagedrun.runtime.distributed.sharding import rank_config, shard_spec

    return rank_config(model_config, shard_spec(model_config, config.tensor_parallel_size, 0))


def _load_model(model: str | None, load_weights: bool = True):
    """(ModelConfig, ModelWeights | None, Tokenizer | None) from an HF directory, a .gguf, or
    None. Tensor parallel: no weights here, each rank reads its own shard."""
    import os

    from pagedrun.runtime.tokenizer import TOKENIZER_FILE, Tokenizer
    from pagedrun.runtime.weights import load_model_weights

    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_model_dir(model_dir)
    weights = load_model_weights(model_dir, config, np.float32) if load_weights else None
    tokenizer = (Tokenizer.from_dir(model_dir)
                 if os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)) else None)
    return config, weights, tokenizer
