# cython: language_level=3
"""Continuous-batching scheduler: token budget, chunked prefill, preemption, SchedulerOutput.

What this module owns
- Every live request's state, in C arrays indexed by an internal slot: token ids (prompt +
  generated), `num_tokens`, `num_computed_tokens`, output count, `max_tokens`, priority,
  arrival order, cache salt, status. Python-facing request ids are ints; `slot_of` maps them
  to slots at the API boundary only.
- The running list (admission order) and the waiting queue (ordered by (priority, arrival);
  FCFS when every priority is 0; swapped-out requests wait in it too).
- `schedule()`: hands out the step's token budget (design note there) and builds a
  `SchedulerOutput` of flat int32 numpy arrays ready for one host-to-device copy.
- `update_from_output()`: advances `num_computed_tokens`, appends sampled tokens, offers newly
  full blocks to the prefix cache, finishes requests and frees their blocks.
- Adapter admission (multi-LoRA): with `max_loras` > 0, at most that many distinct adapters
  (nonzero `lora_id`s) are held by running requests, the device slots the model runner has. A
  waiting request whose adapter is not running while every slot is taken is skipped (it stays
  waiting, not failed) and later requests may still be admitted; a count per active adapter is
  kept, changed wherever a request enters or leaves `running` (admit, fork, finish, abort,
  preempt). `SchedulerOutput.lora_ids` gives each row's adapter.
- Speculative decoding: with `num_speculative_tokens` K > 0, `set_draft_tokens` gives running
  decodes up to K proposed tokens for the next `schedule()` only. A decode row then queries
  1 + k tokens (its last sampled token and k drafts, k cut to the budget left after the other
  decodes' one token each, to what the request may still emit, and to 0 when its blocks do not
  fit -- a draft never preempts anyone); its slots are allocated before the step.
  `update_from_output(..., num_accepted=, accepted_token_ids=)` then appends the accepted drafts
  and the final token, advances `num_computed_tokens` by 1 + accepted (the rejected positions'
  KV is garbage and gets overwritten), hashes only verified tokens into the prefix cache, and
  returns the blocks that hold only rejected tokens to the pool.
- Invariant checks (`check_invariants()`, and after every step when
  `SchedulerConfig.check_invariants`): violations raise `SchedulerInvariantError`.

The API, the output fields, the step contract and when `fork_request` is legal are specified
in docs/scheduler.md. The hot loops run without the GIL; the scheduler is not thread-safe (one
engine thread drives it) and a call from another thread during a hot loop raises.
"""
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memmove, memset
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

import numpy as np

from pagedrun.pyx.block_pool cimport BlockPool
from pagedrun.pyx.kv_cache_manager cimport KVCacheManager, ReqBlocks

# slot_mapping value of a padding token (the runner may pad; the scheduler emits none).
PAD_SLOT_ID = -1
PREEMPTION_MODES = ("recompute", "swap")

cdef enum:
    INITIAL_SLOTS = 64
    # Extra token capacity reserved when a request's token array grows (amortizes realloc).
    TOKEN_CAPACITY_SLACK = 64

cdef enum ReqStatus:
    SLOT_FREE = 0
    WAITING = 1
    SWAPPED = 2
    RUNNING = 3


cdef struct ReqState:
    # Fields every step reads come first (one cache line).
    int32_t* token_ids          # [token_capacity] prompt then generated tokens
    int32_t num_tokens
    int32_t num_computed_tokens  # tokens whose KV is in the cache
    int32_t status
    uint32_t gen                # bumped when the slot is freed (stale SchedulerOutput rows)
    int64_t req_id
    int32_t num_output_tokens
    int32_t max_tokens
    int32_t token_capacity
    int32_t priority            # lower is served first
    int64_t arrival_seq
    uint64_t cache_salt
    int32_t num_prompt_tokens
    int32_t lora_id             # the request's adapter (lora_int_id); 0: the base model


class SchedulerInvariantError(AssertionError):
    """A scheduler / block pool invariant does not hold; the message says which and where."""


class SchedulerConfig:
    """Typed scheduler knobs; see docs/scheduler.md. Raises ValueError naming a bad field."""

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 8192,
                 enable_prefix_caching: bool = True, num_cpu_blocks: int = 0,
                 preemption_mode: str = "recompute", long_prefill_token_threshold: int = 0,
                 check_invariants: bool = False, max_loras: int = 0,
                 num_speculative_tokens: int = 0):
        self.num_gpu_blocks = int(num_gpu_blocks)
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_model_len = int(max_model_len)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.preemption_mode = preemption_mode
        self.long_prefill_token_threshold = int(long_prefill_token_threshold)
        self.check_invariants = bool(check_invariants)
        self.max_loras = int(max_loras)  # 0: no adapter limit (LoRA off)
        # Most draft tokens per request and step (0: speculative decoding off).
        self.num_speculative_tokens = int(num_speculative_tokens)
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if (self.num_cpu_blocks < 0 or self.long_prefill_token_threshold < 0
                or self.max_loras < 0 or self.num_speculative_tokens < 0):
            raise ValueError("num_cpu_blocks, long_prefill_token_threshold, max_loras and "
                             "num_speculative_tokens must be >= 0")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode: must be one of {PREEMPTION_MODES}, "
                             f"got {preemption_mode!r}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"SchedulerConfig({fields})"


cdef class SchedulerOutput:
    """One step's batch. Arrays are C-contiguous and owned by this object (see docs/scheduler.md
    for every field's shape and meaning). Rows: running requests in admission order, then the
    requests admitted this step in queue order."""
    cdef readonly int num_reqs
    cdef readonly int num_batched_tokens
    cdef readonly object req_ids                # int64 [num_reqs]
    cdef readonly object input_token_ids        # int32 [num_batched_tokens]
    cdef readonly object positions              # int32 [num_batched_tokens], 0-based
    cdef readonly object slot_mapping           # int32 [num_batched_tokens]
    cdef readonly object query_start_loc        # int32 [num_reqs + 1]
    cdef readonly object query_lens             # int32 [num_reqs]
    cdef readonly object context_lens           # int32 [num_reqs]
    cdef readonly object num_computed_tokens_before  # int32 [num_reqs]
    cdef readonly object block_tables           # int32 [num_reqs, max_blocks_this_step]
    cdef readonly object sample_mask            # bool [num_reqs]
    cdef readonly object block_copies           # int32 [k, 2] (src, dst)
    cdef readonly object swap_out               # int32 [k, 2] (gpu, host)
    cdef readonly object swap_in                # int32 [k, 2] (host, gpu)
    cdef readonly object preempted_ids          # int64 [k]
    cdef readonly object new_req_ids            # int64 [m]
    cdef readonly object num_prefix_cached_tokens  # int32 [m]
    cdef readonly object lora_ids               # int32 [num_reqs], 0: no adapter
    cdef readonly object num_draft_tokens       # int32 [num_reqs], k of a speculating row
                                                # (its query: last token + k drafts), else 0
    cdef readonly int total_draft_tokens
    cdef readonly int64_t step_id
    cdef object _slots                          # int32 [num_reqs] scheduler slots
    cdef object _slot_gens                      # uint32 [num_reqs]

    def __repr__(self) -> str:
        return (f"SchedulerOutput(step={self.step_id}, num_reqs={self.num_reqs}, "
                f"num_batched_tokens={self.num_batched_tokens}, "
                f"preempted={len(self.preempted_ids)}, new={len(self.new_req_ids)})")


cdef inline int32_t cdiv(int32_t a, int32_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline int32_t _chunk_len(int32_t remaining, int32_t threshold, int32_t limit) noexcept nogil:
    """Tokens of a request's chunk this step: its remaining tokens, capped by the per-request
    threshold (0: no cap) and by `limit` (the budget it may take)."""
    cdef int32_t n = remaining
    if threshold > 0 and n > threshold:
        n = threshold
    return limit if n > limit else n


cdef class Scheduler:
    cdef readonly object config
    cdef readonly KVCacheManager kv
    # config, unpacked for the hot loops
    cdef int32_t block_size, max_num_seqs, max_num_batched_tokens, max_model_len
    cdef int32_t long_prefill_token_threshold
    cdef bint swap_enabled, run_checks
    # request state
    cdef ReqState* reqs                # [num_slots]
    cdef int32_t num_slots
    cdef int32_t* free_slots           # [num_slots] stack
    cdef int32_t num_free_slots
    cdef dict slot_of                  # request id -> slot
    cdef int32_t* running              # [max_num_seqs] slots, admission order
    cdef int32_t num_running_
    cdef int32_t* waiting              # [num_slots] slots; sorted so the next one is last
    cdef int32_t num_waiting_
    cdef int64_t next_arrival_seq
    # one step's scratch (rows of the SchedulerOutput)
    cdef int32_t* row_slot             # [max_num_seqs]
    cdef int32_t* row_query_len
    cdef int32_t* row_num_computed
    cdef int32_t num_rows
    cdef int32_t num_new_rows          # rows [num_rows - num_new_rows, num_rows) were admitted
    cdef int32_t* new_num_cached       # [max_num_seqs] prefix hit tokens of admitted rows
    cdef int32_t* preempted_slots      # [num_slots]
    cdef int32_t num_preempted
    cdef int32_t* finished_slots       # [max_num_seqs]
    cdef int64_t step_id
    cdef bint awaiting_update
    cdef bint in_hot_loop              # a GIL-free section runs (see _enter)
    # counters
    cdef int64_t num_preemptions, prefix_queries, prefix_hits
    # adapters held by running requests: (lora_id, count) pairs, max_loras of them at most
    cdef int32_t max_loras
    cdef int32_t* active_lora_ids      # [max_loras]
    cdef int32_t* active_lora_counts   # [max_loras]
    cdef int32_t num_active_loras
    # Speculative decoding: per request slot, up to max_draft proposed tokens for the next
    # schedule() (set_draft_tokens); kept outside ReqState so fork's memcpy cannot share them.
    cdef int32_t max_draft
    cdef int32_t* draft_tokens         # [num_slots, max_draft]
    cdef int32_t* num_drafts           # [num_slots]
    cdef int32_t* row_num_draft        # [max_num_seqs] drafts scheduled in each row

    def __cinit__(self, config):
        self.reqs = NULL
        self.free_slots = NULL
        self.waiting = NULL
        self.running = NULL
        self.row_slot = NULL
        self.row_query_len = NULL
        self.row_num_computed = NULL
        self.new_num_cached = NULL
        self.preempted_slots = NULL
        self.finished_slots = NULL
        self.active_lora_ids = NULL
        self.active_lora_counts = NULL
        self.draft_tokens = NULL
        self.num_drafts = NULL
        self.row_num_draft = NULL
        self.num_slots = 0

    def __init__(self, config: SchedulerConfig):
        if not isinstance(config, SchedulerConfig):
            raise TypeError("Scheduler(config): config must be a SchedulerConfig")
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.swap_enabled = config.preemption_mode == "swap" and config.num_cpu_blocks > 0
        self.run_checks = config.check_invariants
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size,
                                 config.num_cpu_blocks if self.swap_enabled else 0,
                                 config.enable_prefix_caching, INITIAL_SLOTS)
        cdef int32_t n = self.max_num_seqs
        self.running = <int32_t*>malloc(n * sizeof(int32_t))
        self.row_slot = <int32_t*>malloc(n * sizeof(int32_t))
        self.row_query_len = <int32_t*>malloc(n * sizeof(int32_t))
        self.row_num_computed = <int32_t*>malloc(n * sizeof(int32_t))
        self.new_num_cached = <int32_t*>malloc(n * sizeof(int32_t))
        self.finished_slots = <int32_t*>malloc(n * sizeof(int32_t))
        self.max_loras = config.max_loras
        self.num_active_loras = 0
        self.max_draft = config.num_speculative_tokens
        self.row_num_draft = <int32_t*>malloc(n * sizeof(int32_t))
        # One entry per running request at most, whatever max_loras says.
        self.active_lora_ids = <int32_t*>malloc(n * sizeof(int32_t))
        self.active_lora_counts = <int32_t*>malloc(n * sizeof(int32_t))
        if (self.active_lora_ids == NULL or self.active_lora_counts == NULL
                or self.running == NULL or self.row_slot == NULL or self.row_query_len == NULL
                or self.row_num_computed == NULL or self.new_num_cached == NULL
                or self.finished_slots == NULL or self.row_num_draft == NULL):
            raise MemoryError("Scheduler: out of host memory")
        self.slot_of = {}
        self.num_running_ = 0
        self.num_waiting_ = 0
        self.next_arrival_seq = 0
        self.num_rows = 0
        self.num_new_rows = 0
        self.num_preempted = 0
        self.step_id = 0
        self.awaiting_update = False
        self.in_hot_loop = False
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._grow_slots(INITIAL_SLOTS)

    def __dealloc__(self):
        cdef int32_t s
        if self.reqs != NULL:
            for s in range(self.num_slots):
                free(self.reqs[s].token_ids)
            free(self.reqs)
        free(self.free_slots); free(self.waiting); free(self.running); free(self.row_slot)
        free(self.row_query_len); free(self.row_num_computed); free(self.new_num_cached)
        free(self.preempted_slots); free(self.finished_slots)
        free(self.active_lora_ids); free(self.active_lora_counts)
        free(self.draft_tokens); free(self.num_drafts); free(self.row_num_draft)

    cdef int _grow_slots(self, int32_t num_slots) except -1:
        cdef int32_t old = self.num_slots
        cdef ReqState* reqs = <ReqState*>realloc(self.reqs, num_slots * sizeof(ReqState))
        if reqs == NULL:
            raise MemoryError("Scheduler: out of host memory")
        self.reqs = reqs
        memset(&reqs[old], 0, (num_slots - old) * sizeof(ReqState))
        cdef int32_t* free_slots = <int32_t*>realloc(self.free_slots, num_slots * sizeof(int32_t))
        cdef int32_t* waiting = <int32_t*>realloc(self.waiting, num_slots * sizeof(int32_t))
        cdef int32_t* preempted = <int32_t*>realloc(self.preempted_slots, num_slots * sizeof(int32_t))
        cdef int32_t* num_drafts = <int32_t*>realloc(self.num_drafts, num_slots * sizeof(int32_t))
        cdef int32_t* drafts = <int32_t*>realloc(
            self.draft_tokens, (num_slots * self.max_draft + 1) * sizeof(int32_t))
        if num_drafts != NULL:
            self.num_drafts = num_drafts
            memset(&num_drafts[old], 0, (num_slots - old) * sizeof(int32_t))
        if drafts != NULL:
            self.draft_tokens = drafts
        if num_drafts == NULL or drafts == NULL:
            raise MemoryError("Scheduler: out of host memory")
        if free_slots != NULL:
            self.free_slots = free_slots
        if waiting != NULL:
            self.waiting = waiting
        if preempted != NULL:
            self.preempted_slots = preempted
        if free_slots == NULL or waiting == NULL or preempted == NULL:
            raise MemoryError("Scheduler: out of host memory")
        self.kv.ensure_slots(num_slots)
        cdef int32_t s
        for s in range(num_slots - 1, old - 1, -1):  # lowest slot handed out first
            self.free_slots[self.num_free_slots] = s
            self.num_free_slots += 1
        self.num_slots = num_slots
        return 0

    cdef int32_t _take_slot(self) except -1:
        if self.num_free_slots == 0:
            self._grow_slots(2 * self.num_slots)
        self.num_free_slots -= 1
        return self.free_slots[self.num_free_slots]

    cdef void _release_slot(self, int32_t s) noexcept nogil:
        self.reqs[s].status = SLOT_FREE
        self.reqs[s].gen += 1
        self.free_slots[self.num_free_slots] = s
        self.num_free_slots += 1

    cdef int _enter(self) except -1:
        # Not thread-safe by design (one engine thread drives it); the hot loops release the
        # GIL, so a second thread calling in would race on the C state: fail loudly instead.
        if self.in_hot_loop:
            raise RuntimeError("Scheduler is not thread-safe: called while schedule() or "
                               "update_from_output() runs on another thread")
        return 0

    # ---------------------------------------------------------------- waiting queue
    cdef inline bint _served_before(self, int32_t a, int32_t b) noexcept nogil:
        if self.reqs[a].priority != self.reqs[b].priority:
            return self.reqs[a].priority < self.reqs[b].priority
        return self.reqs[a].arrival_seq < self.reqs[b].arrival_seq

    cdef void _enqueue_waiting(self, int32_t s) noexcept nogil:
        # The array is sorted so the next request to serve is last: find the first position
        # whose request is served before s, insert s there.
        cdef int32_t lo = 0, hi = self.num_waiting_, mid
        while lo < hi:
            mid = (lo + hi) // 2
            if self._served_before(self.waiting[mid], s):
                hi = mid
            else:
                lo = mid + 1
        memmove(&self.waiting[lo + 1], &self.waiting[lo],
                (self.num_waiting_ - lo) * sizeof(int32_t))
        self.waiting[lo] = s
        self.num_waiting_ += 1

    cdef void _remove_from(self, int32_t* arr, int32_t* n, int32_t s) noexcept nogil:
        cdef int32_t i
        for i in range(n[0]):
            if arr[i] == s:
                memmove(&arr[i], &arr[i + 1], (n[0] - i - 1) * sizeof(int32_t))
                n[0] -= 1
                return

    # ---------------------------------------------------------------- adapters
    cdef inline int32_t _lora_index(self, int32_t lora_id) noexcept nogil:
        cdef int32_t i
        for i in range(self.num_active_loras):
            if self.active_lora_ids[i] == lora_id:
                return i
        return -1

    cdef inline bint _lora_can_run(self, int32_t lora_id) noexcept nogil:
        """Whether a request of this adapter may enter `running` now."""
        return (lora_id == 0 or self.max_loras == 0 or self.num_active_loras < self.max_loras
                or self._lora_index(lora_id) >= 0)

    cdef void _lora_enter(self, int32_t lora_id) noexcept nogil:
        """A request of this adapter entered `running`."""
        if lora_id == 0:
            return
        cdef int32_t i = self._lora_index(lora_id)
        if i < 0:
            i = self.num_active_loras
            self.active_lora_ids[i] = lora_id
            self.active_lora_counts[i] = 0
            self.num_active_loras += 1
        self.active_lora_counts[i] += 1

    cdef void _lora_leave(self, int32_t lora_id) noexcept nogil:
        """A request of this adapter left `running` (finished, aborted, preempted)."""
        if lora_id == 0:
            return
        cdef int32_t i = self._lora_index(lora_id)
        if i < 0:
            return  # unreachable: check_invariants compares the table with `running`
        self.active_lora_counts[i] -= 1
        if self.active_lora_counts[i] == 0:
            self.num_active_loras -= 1
            self.active_lora_ids[i] = self.active_lora_ids[self.num_active_loras]
            self.active_lora_counts[i] = self.active_lora_counts[self.num_active_loras]

    # ---------------------------------------------------------------- Python API
    def add_request(self, request_id: int, prompt_token_ids, max_tokens: int,
                    priority: int = 0, cache_salt: int = 0, lora_id: int = 0) -> None:
        """Queue a request. prompt_token_ids: int32 [num_prompt_tokens] (converted if not);
        lora_id: its adapter's lora_int_id (0: the base model)."""
        self._enter()
        if self.awaiting_update:
            raise RuntimeError("add_request between schedule() and update_from_output()")
        prompt = np.ascontiguousarray(prompt_token_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.shape[0] == 0:
            raise ValueError(f"request {request_id}: prompt_token_ids must be a non-empty 1-D array")
        cdef int32_t n = prompt.shape[0]
        if n > self.max_model_len:
            raise ValueError(f"request {request_id}: prompt of {n} tokens exceeds "
                             f"max_model_len={self.max_model_len}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        if request_id in self.slot_of:
            raise ValueError(f"request {request_id}: duplicate live request id")
        if not 0 <= lora_id < 2**31:
            raise ValueError(f"request {request_id}: lora_id must be in [0, 2**31), got {lora_id}")
        if lora_id and self.max_loras == 0:
            raise ValueError(f"request {request_id}: an adapter (lora_id {lora_id}) needs "
                             f"max_loras > 0")
        cdef int64_t longest = min(<int64_t>n + max_tokens, <int64_t>self.max_model_len)
        if cdiv(<int32_t>longest, self.block_size) > self.kv.gpu_pool.num_blocks:
            raise ValueError(f"request {request_id}: up to {longest} tokens can never fit in "
                             f"{self.kv.gpu_pool.num_blocks} blocks of {self.block_size}")
        cdef int32_t s = self._take_slot()
        cdef ReqState* r = &self.reqs[s]
        cdef int32_t cap = n + TOKEN_CAPACITY_SLACK
        cdef int32_t* tokens = <int32_t*>realloc(r.token_ids, cap * sizeof(int32_t))
        if tokens == NULL:
            self._release_slot(s)
            raise MemoryError("Scheduler: out of host memory")
        cdef const int32_t[::1] view = prompt
        memcpy(tokens, &view[0], n * sizeof(int32_t))
        r.token_ids = tokens
        r.token_capacity = cap
        r.req_id = request_id
        r.num_tokens = n
        r.num_prompt_tokens = n
        r.num_computed_tokens = 0
        r.num_output_tokens = 0
        r.max_tokens = min(max_tokens, 2**31 - 1)
        r.priority = priority
        r.arrival_seq = self.next_arrival_seq
        self.next_arrival_seq += 1
        r.cache_salt = <uint64_t>(cache_salt & 0xFFFFFFFFFFFFFFFF)
        r.lora_id = lora_id
        r.status = WAITING
        self.num_drafts[s] = 0
        self.slot_of[request_id] = s
        self._enqueue_waiting(s)

    def abort_request(self, request_id: int) -> bool:
        """Remove a request at any point, freeing its blocks; False if it is not live."""
        self._enter()
        s = self.slot_of.pop(request_id, None)
        if s is None:
            return False
        self._drop(s)
        return True

    cdef void _drop(self, int32_t s) noexcept nogil:
        if self.reqs[s].status == RUNNING:
            self._remove_from(self.running, &self.num_running_, s)
            self._lora_leave(self.reqs[s].lora_id)
        else:
            self._remove_from(self.waiting, &self.num_waiting_, s)
        self.kv.free_blocks(s)
        self._release_slot(s)

    def patch_sampled_tokens(self, SchedulerOutput out, sampled_token_ids) -> int:
        """Asynchronous scheduling (runtime/engine/async_stepper.py): step `out` was updated with
        placeholder tokens before its sampled tokens were read back; write the real ones over
        them (rows where out.sample_mask, at token index context_lens[row]: where
        update_from_output appended it) in the requests still held -- running, waiting or
        swapped (a preempted request keeps its tokens for its recompute). Rows of requests
        freed since (finished, aborted) are skipped. Must run before a later update hashes the
        block holding the token. Returns the number of tokens written."""
        self._enter()
        cdef int32_t R = out.num_reqs
        sampled = np.ascontiguousarray(sampled_token_ids, dtype=np.int32)
        if sampled.ndim != 1 or sampled.shape[0] != R:
            raise ValueError(f"sampled_token_ids must be int32 [{R}], got shape {sampled.shape}")
        mask = np.ascontiguousarray(out.sample_mask, dtype=np.bool_).view(np.uint8)
        cdef const int32_t[::1] tokens = sampled
        cdef const uint8_t[::1] samples = mask
        cdef const int32_t[::1] slots = out._slots
        cdef const uint32_t[::1] gens = out._slot_gens
        cdef const int32_t[::1] context = out.context_lens
        cdef int32_t k, pos, written = 0
        cdef ReqState* r
        for k in range(R):
            if not samples[k]:
                continue
            if slots[k] < 0 or slots[k] >= self.num_slots:
                continue  # not this scheduler's output (never indexes past the slots)
            r = &self.reqs[slots[k]]
            if r.gen != gens[k] or r.status == SLOT_FREE:
                continue
            pos = context[k]
            if pos < r.num_tokens:
                r.token_ids[pos] = tokens[k]
                written += 1
        return written

    def fork_request(self, parent_id: int, child_id: int, child_last_token_id=None) -> None:
        """Child of a running request in decode state sharing all its blocks (docs/scheduler.md)."""
        self._enter()
        if self.awaiting_update:
            raise RuntimeError("fork_request between schedule() and update_from_output()")
        if parent_id not in self.slot_of:
            raise ValueError(f"fork: parent {parent_id} is not live")
        if child_id in self.slot_of:
            raise ValueError(f"fork: child {child_id} is already live")
        cdef int32_t p = self.slot_of[parent_id]
        if (self.reqs[p].status != RUNNING
                or self.reqs[p].num_computed_tokens != self.reqs[p].num_tokens - 1):
            raise ValueError(f"fork: parent {parent_id} must be running with every token but the "
                             f"last computed (status {self.reqs[p].status}, "
                             f"{self.reqs[p].num_computed_tokens}/{self.reqs[p].num_tokens})")
        cdef int32_t c = self._take_slot()
        cdef ReqState* rp = &self.reqs[p]
        cdef ReqState* rc = &self.reqs[c]
        cdef int32_t* tokens = <int32_t*>realloc(rc.token_ids, rp.token_capacity * sizeof(int32_t))
        if tokens == NULL:
            self._release_slot(c)
            raise MemoryError("Scheduler: out of host memory")
        memcpy(tokens, rp.token_ids, rp.num_tokens * sizeof(int32_t))
        cdef uint32_t gen = rc.gen
        memcpy(rc, rp, sizeof(ReqState))
        rc.gen = gen
        rc.token_ids = tokens
        rc.req_id = child_id
        self.num_drafts[c] = 0
        if child_last_token_id is not None:
            rc.token_ids[rc.num_tokens - 1] = child_last_token_id
        self.slot_of[child_id] = c
        if self.num_running_ < self.max_num_seqs:
            if not self.kv.fork(p, c):
                raise MemoryError("fork: out of host memory")
            self.running[self.num_running_] = c
            self.num_running_ += 1
            self._lora_enter(rc.lora_id)  # the parent's adapter: already active
        else:
            rc.num_computed_tokens = 0
            rc.status = WAITING
            self._enqueue_waiting(c)

    def set_draft_tokens(self, request_ids, draft_token_ids, num_draft_tokens) -> None:
        """Proposed tokens for the next schedule() only (speculative decoding); replaces any
        earlier proposal. request_ids int64 [m] (live requests), draft_token_ids int32 [m, >= k]
        (row i's first num_draft_tokens[i] entries), num_draft_tokens int [m] in
        [0, num_speculative_tokens]. A request that is not a running decode when schedule()
        runs ignores its drafts; schedule() drops every proposal once it has run."""
        self._enter()
        if self.awaiting_update:
            raise RuntimeError("set_draft_tokens between schedule() and update_from_output()")
        ids = np.ascontiguousarray(request_ids, dtype=np.int64).reshape(-1)
        counts = np.ascontiguousarray(num_draft_tokens, dtype=np.int32).reshape(-1)
        tokens = np.ascontiguousarray(draft_token_ids, dtype=np.int32)
        cdef int32_t m = ids.shape[0]
        if counts.shape[0] != m or (m and (tokens.ndim != 2 or tokens.shape[0] != m)):
            raise ValueError(f"set_draft_tokens: {m} request ids need num_draft_tokens [{m}] "
                             f"and draft_token_ids [{m}, k], got {counts.shape} and "
                             f"{tokens.shape}")
        if m and (counts.min() < 0 or counts.max() > self.max_draft
                  or counts.max() > tokens.shape[1]):
            raise ValueError(f"set_draft_tokens: counts must lie in [0, "
                             f"num_speculative_tokens={self.max_draft}] and within the rows")
        if m and counts.max() > 0 and tokens[np.arange(tokens.shape[1])[None, :]
                                             < counts[:, None]].min() < 0:
            raise ValueError("set_draft_tokens: negative token id")
        slots = [self._slot(int(i)) for i in ids]  # KeyError names a request that is not live
        self._clear_drafts()
        cdef const int32_t[:, ::1] tok = tokens if m else np.zeros((0, 1), np.int32)
        cdef int32_t i, j, s, k
        for i in range(m):
            s = slots[i]
            k = counts[i]
            self.num_drafts[s] = k
            for j in range(k):
                self.draft_tokens[s * self.max_draft + j] = tok[i, j]

    cdef void _clear_drafts(self) noexcept nogil:
        if self.max_draft > 0:
            memset(self.num_drafts, 0, self.num_slots * sizeof(int32_t))

    def get_decode_request_ids(self):
        """int64 [m]: the running requests whose every token but the last is computed (those
        a proposer may give drafts), in running order."""
        out = np.empty(self.num_running_, dtype=np.int64)
        cdef int32_t i, m = 0
        cdef ReqState* r
        for i in range(self.num_running_):
            r = &self.reqs[self.running[i]]
            if r.num_tokens - r.num_computed_tokens == 1:
                out[m] = r.req_id
                m += 1
        return out[:m]

    @property
    def num_running(self) -> int:
        return self.num_running_

    @property
    def num_waiting(self) -> int:
        return self.num_waiting_

    def has_unfinished_requests(self) -> bool:
        return self.num_running_ + self.num_waiting_ > 0

    def get_token_ids(self, request_id: int):
        """int32 [num_tokens] copy: prompt then generated tokens."""
        cdef int32_t s = self._slot(request_id)
        out = np.empty(self.reqs[s].num_tokens, dtype=np.int32)
        cdef int32_t[::1] view = out
        if self.reqs[s].num_tokens > 0:
            memcpy(&view[0], self.reqs[s].token_ids, self.reqs[s].num_tokens * sizeof(int32_t))
        return out

    def get_num_computed_tokens(self, request_id: int) -> int:
        return self.reqs[self._slot(request_id)].num_computed_tokens

    def get_block_table(self, request_id: int):
        """int32 [num_blocks] copy of the request's block table (host ids when swapped out)."""
        return self.kv.block_table(self._slot(request_id))

    def get_request_status(self, request_id: int) -> str:
        return {WAITING: "waiting", SWAPPED: "swapped", RUNNING: "running"}[
            self.reqs[self._slot(request_id)].status]

    cdef int32_t _slot(self, request_id) except -1:
        s = self.slot_of.get(request_id)
        if s is None:
            raise KeyError(f"request {request_id} is not live")
        return s

    def get_stats(self) -> dict:
        cdef BlockPool pool = self.kv.gpu_pool
        return {
            "num_running": self.num_running_,
            "num_waiting": self.num_waiting_,
            "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "kv_cache_usage": 1.0 - pool.num_free_blocks / pool.num_blocks,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "num_preemptions": self.num_preemptions,
            "num_evictions": pool.num_evictions,
            "num_free_cpu_blocks": self.kv.cpu_pool.num_free_blocks if self.kv.cpu_pool is not None else 0,
        }

    # ---------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (design note in _schedule_core) and return it."""
        self._enter()
        if self.awaiting_update:
            raise RuntimeError("schedule() called again before update_from_output()")
        self.in_hot_loop = True
        try:
            with nogil:
                self._schedule_core()
                self._clear_drafts()  # a proposal is good for one step
            self.step_id += 1
            self.awaiting_update = True
            out = self._build_output()  # also drops the GIL while filling the arrays
        finally:
            self.in_hot_loop = False
        if self.run_checks:
            self._check_step(out)
            self.check_invariants()
        return out

    cdef void _preempt(self, int32_t s) noexcept nogil:
        """Take s (already removed from `running`) back to the waiting queue."""
        self._lora_leave(self.reqs[s].lora_id)
        if self.swap_enabled and self.kv.can_swap_out(s):
            self.kv.swap_out(s)
            self.reqs[s].status = SWAPPED
        else:
            self.kv.free_blocks(s)
            self.reqs[s].num_computed_tokens = 0
            self.reqs[s].status = WAITING
        self._enqueue_waiting(s)
        self.preempted_slots[self.num_preempted] = s
        self.num_preempted += 1
        self.num_preemptions += 1

    cdef inline void _add_row(self, int32_t s, int32_t n, int32_t num_draft=0) noexcept nogil:
        self.row_slot[self.num_rows] = s
        self.row_query_len[self.num_rows] = n
        self.row_num_draft[self.num_rows] = num_draft
        self.row_num_computed[self.num_rows] = self.reqs[s].num_computed_tokens
        self.num_rows += 1

    cdef void _schedule_core(self) noexcept nogil:
        # Design note. There are no prefill and decode phases: every request has
        # `num_computed_tokens` (KV in the cache) and `num_tokens` (prompt + sampled), and each
        # step hands out a budget of `max_num_batched_tokens` query tokens so the first catches
        # up with the second. A request whose gap is 1 is "decoding"; a larger gap is a prompt
        # (or a recomputed sequence) being prefilled in chunks, and a prefix-cache hit simply
        # starts `num_computed_tokens` past the hit blocks.
        # Budget sharing: running requests are served before waiting ones, in admission order.
        # Every running decode is guaranteed its one token: before the pass we count the
        # running decodes, and a running prefill chunk may only take what the decodes behind it
        # leave (budget - decodes not yet served), capped by `long_prefill_token_threshold`.
        # So a long prompt never starves running decodes; it advances by whatever is left.
        # New requests are then admitted from the waiting queue while budget, `max_num_seqs`
        # and free blocks last (head-of-line: the first one that does not fit stops admission;
        # the admitted one gets min(its remaining tokens, threshold, budget left)). A request
        # whose adapter cannot run (max_loras other adapters are running) is skipped, not a
        # stop: it keeps its place and the ones behind it may go.
        # Blocks: when a running request cannot get blocks for its chunk, the most recently
        # admitted running request is preempted (it may be the request itself) until it can.
        # No request is admitted in a step that preempted (it would be the next victim, and it
        # keeps swap-in and swap-out out of the same step).
        # Drafts (speculative decoding): once every running row has its tokens and blocks, a
        # running decode with k proposed tokens queries 1 + k when the budget left allows (else
        # fewer drafts) and the extra blocks fit (else none): drafts only use what is spare,
        # never preempt, and go before admissions (running requests are served first).
        cdef int32_t budget = self.max_num_batched_tokens
        cdef int32_t threshold = self.long_prefill_token_threshold
        cdef int32_t i, s, n, victim, remaining, num_hits, w, k
        cdef int32_t num_decodes_left = 0
        cdef bint preempted_self
        cdef ReqState* r
        self.kv.clear_ops()
        self.num_rows = 0
        self.num_new_rows = 0
        self.num_preempted = 0
        for i in range(self.num_running_):
            r = &self.reqs[self.running[i]]
            if r.num_tokens - r.num_computed_tokens == 1:
                num_decodes_left += 1
        i = 0
        while i < self.num_running_ and budget > 0:
            s = self.running[i]
            r = &self.reqs[s]
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining == 1:
                num_decodes_left -= 1
                n = 1
            else:
                n = _chunk_len(remaining, threshold, budget - num_decodes_left)
                if n <= 0:
                    i += 1
                    continue
            preempted_self = False
            while not self.kv.allocate_slots(s, r.num_computed_tokens, n):
                self.num_running_ -= 1
                victim = self.running[self.num_running_]
                if victim != s and (self.reqs[victim].num_tokens
                                    - self.reqs[victim].num_computed_tokens) == 1:
                    num_decodes_left -= 1
                self._preempt(victim)
                if victim == s:
                    preempted_self = True
                    break
            if preempted_self:
                break
            self._add_row(s, n)
            budget -= n
            i += 1
        if self.num_preempted > 0:
            return
        # Drafts: after every running row has its tokens and blocks, from what is spare.
        if self.max_draft > 0:
            for i in range(self.num_rows):
                if budget <= 0:
                    break
                s = self.row_slot[i]
                r = &self.reqs[s]
                if self.num_drafts[s] == 0 or r.num_tokens - r.num_computed_tokens != 1:
                    continue
                k = self._draft_len(s, budget)
                if k > 0 and self.kv.allocate_slots(s, r.num_computed_tokens, 1 + k):
                    self.row_query_len[i] = 1 + k
                    self.row_num_draft[i] = k
                    budget -= k
        w = self.num_waiting_ - 1
        while w >= 0 and budget > 0 and self.num_running_ < self.max_num_seqs:
            s = self.waiting[w]
            r = &self.reqs[s]
            if not self._lora_can_run(r.lora_id):
                w -= 1
                continue
            num_hits = 0
            if r.status == SWAPPED:
                n = _chunk_len(r.num_tokens - r.num_computed_tokens, threshold, budget)
                if not self.kv.can_swap_in(s, r.num_computed_tokens + n):
                    break
                self.kv.swap_in(s)
                self.kv.allocate_slots(s, r.num_computed_tokens, n)  # fits: can_swap_in counted it
            else:
                num_hits = self.kv.find_cached_prefix(s, r.token_ids, r.num_tokens, r.cache_salt)
                n = _chunk_len(r.num_tokens - num_hits * self.block_size, threshold, budget)
                if not self.kv.allocate_slots(s, num_hits * self.block_size, n):
                    break
                r.num_computed_tokens = num_hits * self.block_size
                self.prefix_queries += r.num_tokens
                self.prefix_hits += num_hits * self.block_size
            # Out of the queue at w (the entries after it are skipped ones: shift them down).
            memmove(&self.waiting[w], &self.waiting[w + 1],
                    (self.num_waiting_ - w - 1) * sizeof(int32_t))
            self.num_waiting_ -= 1
            w -= 1
            self._lora_enter(r.lora_id)
            r.status = RUNNING
            self.running[self.num_running_] = s
            self.num_running_ += 1
            self.new_num_cached[self.num_new_rows] = num_hits * self.block_size
            self.num_new_rows += 1
            self._add_row(s, n)
            budget -= n

    cdef inline int32_t _draft_len(self, int32_t s, int32_t spare) noexcept nogil:
        """How many of slot s's drafts a step may verify: what it proposed, cut to the spare
        budget and to what the request may still emit after the step's final token (max_tokens,
        max_model_len)."""
        cdef ReqState* r = &self.reqs[s]
        cdef int32_t k = self.num_drafts[s]
        if k > spare:
            k = spare
        if k > r.max_tokens - r.num_output_tokens - 1:
            k = r.max_tokens - r.num_output_tokens - 1
        if k > self.max_model_len - r.num_tokens - 1:
            k = self.max_model_len - r.num_tokens - 1
        return k if k > 0 else 0

    cdef object _build_output(self):
        cdef int32_t R = self.num_rows
        cdef int32_t T = 0, max_blocks = 0, k, nb, j, t, pos, q, start, s, nd, total_draft = 0
        cdef int32_t bs = self.block_size
        for k in range(R):
            T += self.row_query_len[k]
            nb = cdiv(self.row_num_computed[k] + self.row_query_len[k], bs)
            if nb > max_blocks:
                max_blocks = nb
        out = SchedulerOutput()
        out.num_reqs = R
        out.num_batched_tokens = T
        out.step_id = self.step_id
        req_ids_arr = np.empty(R, dtype=np.int64)
        input_arr = np.empty(T, dtype=np.int32)
        pos_arr = np.empty(T, dtype=np.int32)
        slot_arr = np.empty(T, dtype=np.int32)
        qsl_arr = np.empty(R + 1, dtype=np.int32)
        qlen_arr = np.empty(R, dtype=np.int32)
        ctx_arr = np.empty(R, dtype=np.int32)
        ncb_arr = np.empty(R, dtype=np.int32)
        bt_arr = np.empty((R, max_blocks), dtype=np.int32)
        sample_arr = np.empty(R, dtype=np.uint8)
        lora_arr = np.empty(R, dtype=np.int32)
        draft_arr = np.empty(R, dtype=np.int32)
        slots_arr = np.empty(R, dtype=np.int32)
        gens_arr = np.empty(R, dtype=np.uint32)
        cdef int64_t[::1] req_ids = req_ids_arr
        cdef int32_t[::1] input_ids = input_arr
        cdef int32_t[::1] positions = pos_arr
        cdef int32_t[::1] slot_mapping = slot_arr
        cdef int32_t[::1] qsl = qsl_arr
        cdef int32_t[::1] qlens = qlen_arr
        cdef int32_t[::1] ctx = ctx_arr
        cdef int32_t[::1] ncb = ncb_arr
        cdef int32_t[:, ::1] bt = bt_arr
        cdef uint8_t[::1] sample = sample_arr
        cdef int32_t[::1] row_lora = lora_arr
        cdef int32_t[::1] row_draft = draft_arr
        cdef const int32_t* drafts
        cdef int32_t[::1] slots = slots_arr
        cdef uint32_t[::1] gens = gens_arr
        cdef ReqState* r
        cdef ReqBlocks* rb
        cdef const int32_t* table
        with nogil:
            t = 0
            qsl[0] = 0
            for k in range(R):
                s = self.row_slot[k]
                r = &self.reqs[s]
                rb = &self.kv.reqs[s]
                table = rb.block_ids
                q = self.row_query_len[k]
                start = self.row_num_computed[k]
                req_ids[k] = r.req_id
                slots[k] = s
                gens[k] = r.gen
                qlens[k] = q
                ncb[k] = start
                ctx[k] = start + q
                qsl[k + 1] = qsl[k] + q
                nd = self.row_num_draft[k]
                row_draft[k] = nd
                total_draft += nd
                sample[k] = (start + q - nd == r.num_tokens)
                row_lora[k] = r.lora_id
                drafts = &self.draft_tokens[s * self.max_draft]
                for j in range(q):
                    pos = start + j
                    # Positions past the request's tokens are its drafts.
                    if pos < r.num_tokens:
                        input_ids[t] = r.token_ids[pos]
                    else:
                        input_ids[t] = drafts[pos - r.num_tokens]
                    positions[t] = pos
                    slot_mapping[t] = table[pos // bs] * bs + pos % bs
                    t += 1
                nb = cdiv(start + q, bs)
                if max_blocks > 0:
                    memcpy(&bt[k, 0], table, nb * sizeof(int32_t))
                    if nb < max_blocks:
                        memset(&bt[k, nb], 0, (max_blocks - nb) * sizeof(int32_t))
        out.req_ids = req_ids_arr
        out.input_token_ids = input_arr
        out.positions = pos_arr
        out.slot_mapping = slot_arr
        out.query_start_loc = qsl_arr
        out.query_lens = qlen_arr
        out.context_lens = ctx_arr
        out.num_computed_tokens_before = ncb_arr
        out.block_tables = bt_arr
        out.sample_mask = sample_arr.view(np.bool_)
        out.lora_ids = lora_arr
        out.num_draft_tokens = draft_arr
        out.total_draft_tokens = total_draft
        out._slots = slots_arr
        out._slot_gens = gens_arr
        ops = self.kv.ops()
        out.block_copies = ops["block_copies"]
        out.swap_out = ops["swap_out"]
        out.swap_in = ops["swap_in"]
        preempted = np.empty(self.num_preempted, dtype=np.int64)
        for k in range(self.num_preempted):
            preempted[k] = self.reqs[self.preempted_slots[k]].req_id
        out.preempted_ids = preempted
        cdef int32_t first_new = R - self.num_new_rows
        out.new_req_ids = req_ids_arr[first_new:].copy()
        cached = np.empty(self.num_new_rows, dtype=np.int32)
        for k in range(self.num_new_rows):
            cached[k] = self.new_num_cached[k]
        out.num_prefix_cached_tokens = cached
        return out

    def update_from_output(self, SchedulerOutput out, sampled_token_ids, stop_mask=None,
                           num_accepted=None, accepted_token_ids=None) -> list:
        """Advance the step's requests; sampled_token_ids int32 [num_reqs] (read where
        out.sample_mask), stop_mask bool [num_reqs] or None. Returns finished request ids.

        Speculating rows (out.num_draft_tokens > 0): num_accepted int32 [num_reqs] says how many
        of the row's drafts were accepted (a <= k; the engine may pass fewer when a stop came
        earlier) and accepted_token_ids int32 [sum(num_accepted)] are those drafts, row after
        row (they must equal the row's first a drafts); the row emits them, then its sampled
        token. None: no draft accepted anywhere."""
        self._enter()
        if not self.awaiting_update or out.step_id != self.step_id:
            raise RuntimeError(f"update_from_output: expected the output of step {self.step_id} "
                               f"once, got step {out.step_id}")
        cdef int32_t R = out.num_reqs
        sampled = np.ascontiguousarray(sampled_token_ids, dtype=np.int32)
        if sampled.ndim != 1 or sampled.shape[0] != R:
            raise ValueError(f"sampled_token_ids must be int32 [{R}], got shape {sampled.shape}")
        if stop_mask is None:
            stops = np.zeros(R, dtype=np.uint8)
        else:
            stops = np.ascontiguousarray(stop_mask, dtype=np.bool_).view(np.uint8)
            if stops.ndim != 1 or stops.shape[0] != R:
                raise ValueError(f"stop_mask must be bool [{R}], got shape {stops.shape}")
        cdef const int32_t[::1] sampled_view = sampled
        cdef const uint8_t[::1] stop_view = stops
        cdef const int32_t[::1] slots = out._slots
        cdef const uint32_t[::1] gens = out._slot_gens
        cdef const int32_t[::1] qlens = out.query_lens
        accepted_counts = np.zeros(R, dtype=np.int32)
        if num_accepted is not None:
            accepted_counts = np.ascontiguousarray(num_accepted, dtype=np.int32)
            if (accepted_counts.shape != (R,) or (accepted_counts < 0).any()
                    or (accepted_counts > out.num_draft_tokens).any()):
                raise ValueError(f"num_accepted must be int32 [{R}] within each row's drafts")
        accepted_flat = np.ascontiguousarray(
            np.zeros(0, np.int32) if accepted_token_ids is None else accepted_token_ids,
            dtype=np.int32).reshape(-1)
        if accepted_flat.shape[0] != int(accepted_counts.sum()):
            raise ValueError(f"accepted_token_ids must hold {int(accepted_counts.sum())} tokens, "
                             f"got {accepted_flat.shape[0]}")
        if accepted_flat.shape[0]:
            qsl = out.query_start_loc
            rows = np.flatnonzero(accepted_counts)
            expected = np.concatenate([out.input_token_ids[qsl[k] + 1:qsl[k] + 1
                                                           + accepted_counts[k]] for k in rows])
            if not np.array_equal(expected, accepted_flat):
                raise ValueError("accepted_token_ids differ from the drafts the step verified")
            accepted_flat = np.concatenate((accepted_flat, np.zeros(1, np.int32)))
        else:
            accepted_flat = np.zeros(1, np.int32)  # a valid pointer for the C loop
        cdef const int32_t[::1] acc_counts = accepted_counts
        cdef const int32_t[::1] acc_tokens = accepted_flat
        cdef const int32_t[::1] row_drafts = out.num_draft_tokens
        cdef int32_t num_finished = 0
        self.in_hot_loop = True
        with nogil:
            num_finished = self._update_core(R, &slots[0] if R > 0 else NULL,
                                             &gens[0] if R > 0 else NULL,
                                             &qlens[0] if R > 0 else NULL,
                                             &sampled_view[0] if R > 0 else NULL,
                                             &stop_view[0] if R > 0 else NULL,
                                             &row_drafts[0] if R > 0 else NULL,
                                             &acc_counts[0] if R > 0 else NULL,
                                             &acc_tokens[0])
        self.in_hot_loop = False
        if num_finished < 0:
            raise MemoryError("Scheduler: out of host memory")
        finished = []
        cdef int32_t k, s
        for k in range(num_finished):
            s = self.finished_slots[k]
            finished.append(self.reqs[s].req_id)
            del self.slot_of[self.reqs[s].req_id]
        for k in range(num_finished):  # few per step: no need to drop the GIL here
            self.kv.free_blocks(self.finished_slots[k])
            self._release_slot(self.finished_slots[k])
        self.awaiting_update = False
        if self.run_checks:
            self.check_invariants()
        return finished

    cdef int32_t _update_core(self, int32_t R, const int32_t* slots, const uint32_t* gens,
                              const int32_t* qlens, const int32_t* sampled,
                              const uint8_t* stops, const int32_t* row_drafts,
                              const int32_t* acc_counts,
                              const int32_t* acc_tokens) noexcept nogil:
        cdef int32_t k, s, i, j, cap, num_finished = 0, num_new, advance
        cdef int32_t acc_offset = 0
        cdef int32_t* grown
        cdef ReqState* r
        cdef int32_t bs = self.block_size
        for k in range(R):
            s = slots[k]
            r = &self.reqs[s]
            num_new = acc_counts[k]  # accepted drafts: emitted before the sampled token
            acc_offset += num_new
            if r.gen != gens[k] or r.status != RUNNING:
                continue  # aborted (or the slot reused) since schedule()
            # The KV that holds: the query minus its rejected drafts.
            advance = qlens[k] - row_drafts[k] + num_new
            if r.num_computed_tokens + advance == r.num_tokens + num_new:
                # Room for the accepted drafts and the sampled token, appended before hashing
                # (the accepted drafts' blocks are hashed with them).
                if r.num_tokens + num_new + 1 > r.token_capacity:
                    cap = r.token_capacity * 2
                    while cap < r.num_tokens + num_new + 1:
                        cap *= 2
                    grown = <int32_t*>realloc(r.token_ids, cap * sizeof(int32_t))
                    if grown == NULL:
                        return -1
                    r.token_ids = grown
                    r.token_capacity = cap
                memcpy(&r.token_ids[r.num_tokens], &acc_tokens[acc_offset - num_new],
                       num_new * sizeof(int32_t))
                r.num_tokens += num_new
                r.num_output_tokens += num_new
            r.num_computed_tokens += advance
            # Blocks became full this step: offer them to the prefix cache (this test, not the
            # manager's num_hashed_blocks, keeps a decode step off the manager's memory).
            if r.num_computed_tokens // bs != (r.num_computed_tokens - advance) // bs:
                self.kv.cache_full_blocks(s, r.token_ids, r.num_computed_tokens, r.cache_salt)
            if row_drafts[k] > num_new:
                # Blocks past the computed tokens' go back to the pool now: the table is what
                # a plain decode step would have left (a fork shares nothing beyond it).
                self.kv.trim_blocks(s, r.num_computed_tokens)
            if r.num_computed_tokens != r.num_tokens:
                continue  # a prefill chunk: nothing sampled
            r.token_ids[r.num_tokens] = sampled[k]
            r.num_tokens += 1
            r.num_output_tokens += 1
            if (stops[k] or r.num_output_tokens >= r.max_tokens
                    or r.num_tokens >= self.max_model_len):
                r.status = SLOT_FREE  # out of `running`; the slot is released by the caller
                self._lora_leave(r.lora_id)
                self.finished_slots[num_finished] = s
                num_finished += 1
        if num_finished > 0:
            j = 0
            for i in range(self.num_running_):
                if self.reqs[self.running[i]].status == RUNNING:
                    self.running[j] = self.running[i]
                    j += 1
            self.num_running_ = j
        return num_finished

    # ---------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise SchedulerInvariantError unless every block / queue invariant holds."""
        try:
            self.kv.check_invariants()
        except AssertionError as e:
            raise SchedulerInvariantError(f"block pool: {e}") from None
        cdef int32_t i, s, prev
        cdef ReqState* r
        cdef ReqBlocks* rb
        if self.num_running_ > self.max_num_seqs:
            raise SchedulerInvariantError(f"{self.num_running_} running > max_num_seqs={self.max_num_seqs}")
        if len(self.slot_of) != self.num_running_ + self.num_waiting_:
            raise SchedulerInvariantError(f"{len(self.slot_of)} live ids != {self.num_running_} running "
                                          f"+ {self.num_waiting_} waiting")
        for req_id, s in self.slot_of.items():
            if self.reqs[s].req_id != req_id or self.reqs[s].status == SLOT_FREE:
                raise SchedulerInvariantError(f"request {req_id}: slot {s} holds "
                                              f"{self.reqs[s].req_id} (status {self.reqs[s].status})")
        for i in range(self.num_running_):
            s = self.running[i]
            r = &self.reqs[s]
            rb = &self.kv.reqs[s]
            if r.status != RUNNING:
                raise SchedulerInvariantError(f"request {r.req_id} in running has status {r.status}")
            if rb.on_host:
                raise SchedulerInvariantError(f"running request {r.req_id} has its blocks on the host")
            if not 0 <= r.num_computed_tokens < r.num_tokens:
                raise SchedulerInvariantError(
                    f"running request {r.req_id}: num_computed_tokens {r.num_computed_tokens} "
                    f"not in [0, num_tokens={r.num_tokens})")
            if rb.num_blocks < cdiv(r.num_computed_tokens, self.block_size):
                raise SchedulerInvariantError(
                    f"running request {r.req_id}: {rb.num_blocks} blocks cannot hold "
                    f"{r.num_computed_tokens} computed tokens")
        self._check_loras()
        for i in range(self.num_waiting_):
            s = self.waiting[i]
            r = &self.reqs[s]
            rb = &self.kv.reqs[s]
            if i > 0 and self._served_before(self.waiting[i - 1], s):
                raise SchedulerInvariantError(f"waiting queue out of order at position {i}")
            if r.status == WAITING:
                if rb.num_blocks != 0 or r.num_computed_tokens != 0:
                    raise SchedulerInvariantError(
                        f"waiting request {r.req_id} holds {rb.num_blocks} blocks / "
                        f"{r.num_computed_tokens} computed tokens")
            elif r.status == SWAPPED:
                if not rb.on_host or rb.num_blocks < cdiv(r.num_computed_tokens, self.block_size):
                    raise SchedulerInvariantError(f"swapped request {r.req_id}: blocks not on the host")
            else:
                raise SchedulerInvariantError(f"request {r.req_id} in waiting has status {r.status}")
        for i in range(self.num_slots):
            r = &self.reqs[i]
            if r.status == SLOT_FREE and self.kv.reqs[i].num_blocks != 0:
                raise SchedulerInvariantError(f"free slot {i} still holds {self.kv.reqs[i].num_blocks} blocks")
            if r.status != SLOT_FREE and r.num_tokens > self.max_model_len:
                raise SchedulerInvariantError(f"request {r.req_id}: {r.num_tokens} tokens > max_model_len")

    def _check_loras(self) -> None:
        """The active-adapter table counts exactly the running requests of each adapter."""
        cdef int32_t i
        counts = {}
        for i in range(self.num_running_):
            lora_id = self.reqs[self.running[i]].lora_id
            if lora_id:
                counts[lora_id] = counts.get(lora_id, 0) + 1
        table = {self.active_lora_ids[i]: self.active_lora_counts[i]
                 for i in range(self.num_active_loras)}
        if table != counts or len(table) != self.num_active_loras:
            raise SchedulerInvariantError(f"active adapters {table} != running requests' "
                                          f"adapters {counts}")
        if self.max_loras and self.num_active_loras > self.max_loras:
            raise SchedulerInvariantError(f"{self.num_active_loras} adapters running > "
                                          f"max_loras={self.max_loras}")

    def get_active_lora_ids(self) -> list:
        """The adapters running requests hold (lora_ids, no order)."""
        return [self.active_lora_ids[i] for i in range(self.num_active_loras)]

    def _check_step(self, SchedulerOutput out) -> None:
        """Per-step checks of a fresh output: budget, max_num_seqs, slots, no shared writes."""
        cdef int32_t bs = self.block_size
        if out.num_batched_tokens > self.max_num_batched_tokens:
            raise SchedulerInvariantError(f"step {out.step_id}: {out.num_batched_tokens} tokens > "
                                          f"max_num_batched_tokens={self.max_num_batched_tokens}")
        if out.num_reqs > self.max_num_seqs:
            raise SchedulerInvariantError(f"step {out.step_id}: {out.num_reqs} rows > max_num_seqs")
        if len(out.swap_in) and len(out.swap_out):
            raise SchedulerInvariantError(f"step {out.step_id}: swap-in and swap-out in one step")
        slot_mapping = out.slot_mapping
        if len(np.unique(slot_mapping)) != len(slot_mapping):
            vals, counts = np.unique(slot_mapping, return_counts=True)
            raise SchedulerInvariantError(f"step {out.step_id}: slots written twice: "
                                          f"{vals[counts > 1][:8].tolist()}")
        if np.any(np.asarray(out.query_lens) < 1):
            raise SchedulerInvariantError(f"step {out.step_id}: a row with no query tokens")
        ids = np.asarray(out.req_ids)
        if len(np.unique(ids)) != len(ids):
            raise SchedulerInvariantError(f"step {out.step_id}: a request appears in two rows")
        qsl = out.query_start_loc
        cdef BlockPool pool = self.kv.gpu_pool
        for k in range(out.num_reqs):
            a, b = int(qsl[k]), int(qsl[k + 1])
            start = int(out.num_computed_tokens_before[k])
            expected = np.arange(start, start + (b - a), dtype=np.int32)
            if not np.array_equal(out.positions[a:b], expected):
                raise SchedulerInvariantError(f"step {out.step_id}: request {ids[k]} positions "
                                              f"{out.positions[a:b][:4]}.. != {start}..")
            blocks = out.block_tables[k][expected // bs]
            if not np.array_equal(out.slot_mapping[a:b], blocks * bs + expected % bs):
                raise SchedulerInvariantError(f"step {out.step_id}: request {ids[k]} slot_mapping "
                                              f"does not follow its block table")
            for blk in np.unique(blocks):
                if pool.ref_cnt[blk] != 1:
                    raise SchedulerInvariantError(
                        f"step {out.step_id}: request {ids[k]} writes into block {blk} shared by "
                        f"{pool.ref_cnt[blk]} tables (copy-on-write missed)")
