# cython: language_level=3
"""Continuous-batching scheduler (STUB: the API is final, the body lands next; see docs/scheduler.md)."""
import numpy as np

PAD_SLOT_ID = -1


class SchedulerConfig:
    def __init__(self, num_gpu_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 8192,
                 enable_prefix_caching: bool = True, num_cpu_blocks: int = 0,
                 preemption_mode: str = "recompute", long_prefill_token_threshold: int = 0,
                 check_invariants: bool = False):
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self.preemption_mode = preemption_mode
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.check_invariants = check_invariants


class SchedulerOutput:
    pass


class Scheduler:
    def __init__(self, config):
        self.config = config

    def add_request(self, request_id, prompt_token_ids, max_tokens, priority=0, cache_salt=0):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def schedule(self):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def update_from_output(self, out, sampled_token_ids, stop_mask=None):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def abort_request(self, request_id):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def fork_request(self, parent_id, child_id, child_last_token_id=None):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def get_token_ids(self, request_id):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def get_stats(self):
        raise NotImplementedError("issue 3: scheduler body not landed yet")

    def check_invariants(self):
        raise NotImplementedError("issue 3: scheduler body not landed yet")
