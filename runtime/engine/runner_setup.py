"""The engine's runner, built once: the model on its device with the KV pools placed, the
speculative draft model beside it, the decode graphs captured.

One device: a ModelRunner, its KV budget measured by profiling the runner's own model where
the backend needs it (kv_capacity.plan_num_kv_blocks). Several ranks: the tensor / pipeline
parallel executor, every rank's KV sized by the rank-0 shard's bytes per block. A draft model's
KV shares the block ids, so a block costs both models' bytes.
"""
from __future__ import annotations

import logging
from functools import partial

from pagedrun.runtime.decode_graphs import graph_sizes
from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.kv_capacity import num_swap_blocks, plan_num_kv_blocks
from pagedrun.runtime.model_loader import load_model
from pagedrun.runtime.model_runner import ModelRunner

from .runner import Runner

log = logging.getLogger("pagedrun.engine")


def start_runner(config, model_config, weights, backend, max_model_len: int, lora_config,
                 draft: ModelRunner | None) -> Runner:
    """The runner with its KV pools placed (module docstring)."""
    if config.world_size > 1:
        from pagedrun.runtime.distributed.executor import start_tensor_parallel

        if weights is not None:
            raise PagedRunError("tensor parallel ranks read their shards from a model "
                                "directory; give EngineConfig.model instead of in-memory "
                                "weights")
        return start_tensor_parallel(config, model_config, backend, max_model_len)
    runner = ModelRunner(model_config, weights, block_size=config.block_size,
                         max_model_len=max_model_len, ops=backend, lora_config=lora_config)
    bytes_per_block = runner.kv_bytes_per_block() + (
        draft.kv_bytes_per_block() if draft is not None else 0)
    max_step_tokens = min(config.max_num_batched_tokens, max_model_len)
    num_blocks = plan_num_kv_blocks(config, backend, bytes_per_block, max_model_len,
                                    profile=partial(runner.profile_run, max_step_tokens))
    num_swap = num_swap_blocks(config, bytes_per_block)
    runner.allocate_kv_cache(num_blocks, num_swap)
    if draft is not None:
        draft.allocate_kv_cache(num_blocks, num_swap)
    _capture_graphs(config, backend, runner)
    return runner


def _capture_graphs(config, backend, runner: ModelRunner) -> None:
    """Decode graphs (runtime/decode_graphs.py) for the configured batch sizes, unless
    enforce_eager or the backend / model cannot; the log says which."""
    sizes = graph_sizes(config, backend)
    if not sizes:
        return
    why_not = runner.capture_decode_graphs(sizes)
    if why_not is not None:
        log.info("decode graphs: off (%s); every step runs eagerly", why_not)


def draft_runner(config, spec_config, draft_model, model_config, backend,
                 max_model_len: int) -> ModelRunner | None:
    """The speculative draft model's runner (its KV pools are placed with the target's by
    start_runner), or None unless the method is "draft_model". It must share the target's
    vocabulary. `draft_model`: (config, weights) instead of loading spec_config.model."""
    if spec_config is None or spec_config.method != "draft_model":
        if draft_model is not None:
            raise PagedRunError("draft_model given but speculative_config's method is not "
                                "'draft_model'")
        return None
    if config.tensor_parallel_size > 1:
        raise PagedRunError("speculative_config: a draft model runs with "
                            "tensor_parallel_size 1 only (ngram works with any)")
    if draft_model is None:
        draft_config, draft_weights, _ = load_model(spec_config.model)
    else:
        draft_config, draft_weights = draft_model
    if draft_config.vocab_size != model_config.vocab_size:
        raise PagedRunError(f"speculative_config: the draft model's vocabulary "
                            f"({draft_config.vocab_size}) differs from the target's "
                            f"({model_config.vocab_size}); it must share the tokenizer")
    backend.check_model(draft_config, config.block_size)
    return ModelRunner(draft_config, draft_weights, block_size=config.block_size,
                       max_model_len=max_model_len, ops=backend)
