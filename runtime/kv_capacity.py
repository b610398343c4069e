"""KV capacity planning: the longest request (max_model_len) and how many KV blocks a device
holds, fixed before serving and logged, so requests that can never run are refused at admission.

    max_model_len = resolve_max_model_len(model_config, config.max_model_len)
    num_blocks = plan_num_kv_blocks(config, backend, bytes_per_block, max_model_len, profile)

The memory budget comes from the backend (a fixed host budget on cpu / sim; on cuda, what
gpu_memory_utilization leaves after the weights and a maximum-size step, which `profile` runs);
nothing here knows which device it is.
"""
from __future__ import annotations

import logging
import math

from pagedrun.runtime.engine_config import EngineConfig
from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.model_config import ModelConfig

log = logging.getLogger("pagedrun.engine")

# max_model_len when the user names none: the model's max_position_embeddings, capped, because
# a 128k default would make "one request at max length" (the capacity check) meaningless on CPU.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


def resolve_max_model_len(model_config: ModelConfig, max_model_len: int | None) -> int:
    """The user's max_model_len checked against the model, or the capped model maximum; never
    past a sliding window (the attention ops have no window: within it, full attention is
    exact)."""
    model_max = model_config.max_position_embeddings
    if max_model_len is None:
        max_len = min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
    else:
        max_len = max_model_len
        if not 1 <= max_len <= model_max:
            raise PagedRunError(f"max_model_len: must be in [1, {model_max}] "
                                f"(max_position_embeddings), got {max_len}")
    window = model_config.sliding_window
    if window is not None and max_len > window:
        log.warning("max_model_len %d capped to the sliding window %d", max_len, window)
        max_len = window
    return max_len


def plan_num_kv_blocks(config: EngineConfig, backend, bytes_per_block: int, max_model_len: int,
                       profile=None) -> int:
    """config.num_kv_blocks, or the blocks of the memory budget: config.kv_cache_memory_bytes,
    else the backend's (`Backend.kv_cache_budget_bytes`, which may run `profile`). Never more
    than every sequence at max length could use."""
    if config.num_kv_blocks is not None:
        if config.num_kv_blocks < 1:
            raise PagedRunError(f"num_kv_blocks: must be >= 1, got {config.num_kv_blocks}")
        return config.num_kv_blocks
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = backend.kv_cache_budget_bytes(
            profile, gpu_memory_utilization=config.gpu_memory_utilization)
    useful = config.max_num_seqs * math.ceil(max_model_len / config.block_size)
    num = min(budget // bytes_per_block, useful)
    if num < 1:
        raise PagedRunError(f"KV budget {budget} bytes holds no {bytes_per_block}-byte block")
    return int(num)


def num_swap_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Host blocks of the swap pool (swap preemption only)."""
    return config.swap_space_bytes // bytes_per_block if config.preemption_mode == "swap" else 0
