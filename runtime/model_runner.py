"""Model runner: SchedulerOutput -> device inputs -> forward -> logits. The only device-memory user.

It owns the model weights and the KV cache pools (per layer K and V, the device pool and the
host swap pool), executes a step's block moves (swap out, swap in, copy-on-write, in the order
the scheduler's contract names) before the forward, and returns logits only where they are
needed: the last token of each row that samples, plus every query token of the rows whose request
asked for prompt logprobs.

Decode graphs (runtime/decode_graphs.py): after `capture_decode_graphs`, a pure-decode step
that fits a captured batch size replays its graph instead of launching the forward op by op.

Multi-LoRA: with a LoRAConfig the runner also owns the adapters' device slots (a
LoRAWeightStack sized max_loras x max_lora_rank). The engine's AdapterCache decides which adapter
sits in which slot; the runner loads an adapter's part for its device (`load_adapter`: the whole
adapter, or a tensor-parallel rank's shard), fills slots between steps (`apply_lora_writes`) and,
given each row's slot (`execute(..., row_lora_slots=)`, -1: none), groups the step's tokens by
slot once for every layer. A step in which no row has an adapter runs exactly the base forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.backends.step_inputs import DeviceInts
from pagedrun.runtime.decode_graphs import DecodeGraphs
from pagedrun.runtime.lora.lora_config import LoRAConfig
from pagedrun.runtime.lora.lora_ops import LoRABatch
from pagedrun.runtime.lora.peft_loader import load_peft_adapter
from pagedrun.runtime.lora.weight_stack import LoRAWeightStack
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.llama import AttentionInputs
from pagedrun.runtime.models.registry import build_model
from pagedrun.runtime.weights import ModelWeights

KV_DTYPE = np.float32
_DECODE_QUERY_LEN = 1


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype=KV_DTYPE) -> int:
    """Bytes one block takes across all layers, K and V."""
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * config.head_dim * np.dtype(dtype).itemsize)


@dataclass
class RunnerOutput:
    """Logits of one step.

    sample_rows: [num_sampled] int64, the batch rows (of SchedulerOutput) that sample a token.
    logits: [num_sampled, vocab] float32, the logits of each sample row's last query token
        (numpy; the backend's array -- cupy on cuda -- when the runner keeps logits on device).
    prompt_logits: batch row -> [query_len, vocab] float32 logits of every query token of that
        row (rows asked for in `execute`'s `prompt_logit_rows` only).
    logits_start: None when no row verifies drafts (logits row i is sample row i's); else
        int64 [num_sampled + 1]: sample row i's logits are rows logits_start[i] ..
        logits_start[i + 1] - 1, one per query position from its last sampled token on (1 + k
        for a row verifying k drafts, speculative decoding).
    """

    sample_rows: np.ndarray
    logits: np.ndarray
    prompt_logits: dict[int, np.ndarray]
    logits_start: np.ndarray | None = None


def _rows(mask: np.ndarray) -> slice | np.ndarray:
    """Indices where mask is true, as a slice if they are contiguous (cheaper to index with)."""
    idx = np.flatnonzero(mask)
    if idx.size and idx[-1] - idx[0] + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def build_attention_inputs(query_start_loc: np.ndarray, query_lens: np.ndarray,
                           context_lens: np.ndarray, block_tables: np.ndarray,
                           num_draft_tokens: np.ndarray | None = None) -> AttentionInputs:
    """Split a step's rows into decode rows (query_len 1) and prefill rows, with token indices.

    query_start_loc: [num_reqs + 1] int32; query_lens, context_lens: [num_reqs] int32;
    block_tables: [num_reqs, max_blocks] int32; num_draft_tokens: [num_reqs] int32 or None.
    A row verifying k drafts (speculative decoding) becomes 1 + k decode rows, one per query
    token, each seeing the context up to its own position (the step writes every token's KV
    before attention): decode attention over a few queries per sequence costs far less than
    the prefill path for such short queries.
    """
    num_tokens = int(query_start_loc[-1])
    is_decode = query_lens == _DECODE_QUERY_LEN
    if num_draft_tokens is not None and num_draft_tokens.any():
        is_decode = is_decode | (num_draft_tokens > 0)
        spec = is_decode & (query_lens > 1)
        repeats = np.where(spec, query_lens, 1)[is_decode]
        rows = np.repeat(np.flatnonzero(is_decode), repeats)
        # Each virtual row's context ends at its own token: the row's first token's context
        # length, then one more per token.
        first = np.repeat(np.concatenate(([0], np.cumsum(repeats)[:-1])), repeats)
        offsets = np.arange(rows.size) - first
        decode_tables = block_tables[rows]
        decode_context = (context_lens[rows] - query_lens[rows] + 1 + offsets).astype(np.int32)
    else:
        decode_tables, decode_context = block_tables[is_decode], context_lens[is_decode]
    num_decode = int(decode_context.size)
    num_prefill = int(is_decode.size - is_decode.sum())
    token_is_decode = np.repeat(is_decode, query_lens)
    if num_prefill == 0:
        decode_rows, prefill_rows = slice(0, num_tokens), slice(0, 0)
    elif num_decode == 0:
        decode_rows, prefill_rows = slice(0, 0), slice(0, num_tokens)
    else:
        decode_rows, prefill_rows = _rows(token_is_decode), _rows(~token_is_decode)
    prefill_lens = query_lens[~is_decode]
    prefill_qsl = np.zeros(num_prefill + 1, dtype=np.int32)
    np.cumsum(prefill_lens, out=prefill_qsl[1:])
    return AttentionInputs(
        decode_token_rows=decode_rows,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_context,
        prefill_token_rows=prefill_rows,
        prefill_block_tables=block_tables[~is_decode],
        prefill_query_start_loc=prefill_qsl,
        prefill_context_lens=context_lens[~is_decode],
        num_decode=num_decode,
        num_prefill=num_prefill,
    )


@dataclass
class TokenSource:
    """Input tokens of a step that are still on the device (asynchronous scheduling: the
    previous step's sampled ids, not yet read back; the host copy holds placeholders there).

    positions: int64 [k] indices into the step's input_token_ids; ids: the backend's int32
    device array; id_rows: int64 [k] the index into `ids` of each position's token."""

    positions: np.ndarray
    ids: object
    id_rows: np.ndarray

    def scatter_into(self, ops, tokens) -> None:
        """tokens[positions] = ids[id_rows], on the device (tokens: int32 device array)."""
        ops.scatter_ids(tokens, self.positions, self.ids, self.id_rows)


@dataclass
class LoRAStep:
    """The adapters of one step, as LlamaModel.forward reads them."""

    stack: LoRAWeightStack   # every slot's weights
    batch: object            # the backend's lora_batch of the step's LoRABatch


class ModelRunner:
    """Weights, KV pools and the step's forward on one device, through its backend (`ops`).

    Built in two phases, as the KV budget may depend on what the model needs per step:
    construct (the forward over the weights), optionally `profile_run` (one maximum-size step,
    which the backend measures), then `allocate_kv_cache` with the blocks the budget gives.
    """

    pipeline_depth = 1  # one batch at a time (runtime/engine/runner.py's Runner protocol)

    def __init__(self, config: ModelConfig, weights: ModelWeights | None, *, block_size: int,
                 max_model_len: int, ops, num_gpu_blocks: int | None = None,
                 num_cpu_blocks: int = 0, model=None,
                 logits_on_device: bool | None = None, lora_config: LoRAConfig | None = None,
                 load_adapter=None) -> None:
        """`model`: a prebuilt forward to use instead of the registry's for `config` (a
        tensor-parallel rank's shard; `config` is then that rank's config, see
        runtime/distributed/sharding.py, so the KV pools hold only its KV heads).
        `num_gpu_blocks`: allocate the KV pools now (else call `allocate_kv_cache` later).
        `logits_on_device`: RunnerOutput.logits stays the backend's float32 array (its sampler
        reads it where it is; only token ids come back) instead of a numpy copy; default: what
        the backend says (`ops.logits_on_device`).
        `lora_config`: serve adapters (slot stacks for this runner's `config`); `load_adapter`
        (LoRARequest -> LoRAAdapter for this device, default: the whole adapter for `config`)
        is what a tensor-parallel rank replaces with its shard's loader."""
        self.config = config
        self.ops = ops
        self.logits_on_device = (ops.logits_on_device if logits_on_device is None
                                 else logits_on_device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = (model if model is not None
                      else build_model(config, weights, ops, max_position=max_model_len))
        self.lora_config = lora_config
        self.lora_stack = None
        self._load_adapter = load_adapter
        if lora_config is not None:
            dtype, xp = ops.lora_weights
            self.lora_stack = LoRAWeightStack(config, lora_config.max_loras,
                                              lora_config.max_lora_rank, dtype=dtype, xp=xp,
                                              first_layer=getattr(self.model, "first_layer", 0))
        self.num_gpu_blocks = self.num_cpu_blocks = 0
        self.k_caches: list = []
        self.v_caches: list = []
        self.cpu_caches: list[np.ndarray] = []
        # Per virtual engine (pipeline parallelism: one batch in flight per stage, each with
        # its own scheduler and pools): (k_caches, v_caches, cpu_caches); entry 0 is the three
        # attributes above.
        self.kv_sets: list[tuple[list, list, list]] = []
        self.decode_graphs: DecodeGraphs | None = None
        if num_gpu_blocks is not None:
            self.allocate_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def close(self) -> None:
        """Nothing to release: the pools are the backend's arrays (the Runner protocol)."""

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, lora_request):
        """This device's part of an adapter (host arrays; LoRALoadError when unusable)."""
        if self.lora_config is None:
            raise ValueError("this runner was built without LoRA (lora_config is None)")
        if self._load_adapter is not None:
            return self._load_adapter(lora_request)
        return load_peft_adapter(lora_request, self.config, self.lora_config.max_lora_rank)

    def apply_lora_writes(self, writes) -> None:
        """Fill device slots before the next step: each write has .slot and .adapter (this
        device's part, AdapterCache's load result)."""
        for write in writes:
            self.lora_stack.write_slot(write.slot, write.adapter)

    def _lora_step(self, out, row_lora_slots) -> LoRAStep | None:
        """The step's LoRA inputs, or None when no row has an adapter (the base forward)."""
        if row_lora_slots is None or self.lora_stack is None:
            return None
        slots = np.asarray(row_lora_slots)
        if not (slots >= 0).any():
            return None
        batch = LoRABatch.from_request_slots(slots, out.query_lens, self.lora_stack.max_loras)
        return LoRAStep(self.lora_stack, self.ops.lora_batch(batch))

    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes on this runner's device, all layers, K and V."""
        return kv_bytes_per_block(self.config, self.block_size, self.ops.kv_dtype)

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                          num_virtual_engines: int = 1) -> None:
        """Place the KV pools: per layer K and V of [num_gpu_blocks, block_size, num_kv_heads,
        head_dim] on the device, and the host swap pool of num_cpu_blocks blocks; one such set
        per virtual engine (each a scheduler of its own with block ids from 0)."""
        config = self.config
        block_shape = (self.block_size, config.num_key_value_heads, config.head_dim)
        # The backend places the pools (np.zeros maps untouched pages lazily on cpu/sim, so a
        # large pool costs memory only as it fills); the swap pool is host memory.
        kv_dtype = self.ops.kv_dtype
        self.decode_graphs = None  # bound to the old pools: capture again
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.kv_sets = []
        for _ in range(num_virtual_engines):
            self.kv_sets.append((
                [self.ops.zeros((num_gpu_blocks, *block_shape), kv_dtype)
                 for _ in range(config.num_hidden_layers)],
                [self.ops.zeros((num_gpu_blocks, *block_shape), kv_dtype)
                 for _ in range(config.num_hidden_layers)],
                [np.zeros((num_cpu_blocks, *block_shape), kv_dtype)
                 for _ in range(2 * config.num_hidden_layers)] if num_cpu_blocks else []))
        self.k_caches, self.v_caches, self.cpu_caches = self.kv_sets[0]

    def capture_decode_graphs(self, sizes) -> str | None:
        """Capture the decode forward for each batch size in `sizes` over the KV pools of
        virtual engine 0 (call after allocate_kv_cache). Returns None, or why nothing was
        captured (the backend or the model cannot; the steps then all run eagerly)."""
        if not self.ops.capabilities.graphs:
            return f"the {self.ops.name} backend has no graphs"
        if len(self.kv_sets) != 1:
            return "pipeline virtual engines"
        reason = self.model.graph_capture_refusal()
        if reason is not None:
            return reason
        graphs = DecodeGraphs(self.model, self.ops, self.k_caches, self.v_caches, sizes=sizes,
                              max_model_len=self.max_model_len, block_size=self.block_size)
        graphs.capture()
        self.decode_graphs = graphs
        return None

    def profile_run(self, num_tokens: int) -> int:
        """One prefill of `num_tokens` tokens (one request, token id 0) on a scratch KV pool just
        large enough, through the real forward and LM head, so the backend can measure the peak
        of a maximum-size step. Frees everything it allocated; returns the scratch pool's bytes.
        Call before `allocate_kv_cache`."""
        config = self.config
        num_tokens = max(1, num_tokens)
        num_blocks = -(-num_tokens // self.block_size)
        shape = (num_blocks, self.block_size, config.num_key_value_heads, config.head_dim)
        k_caches = [self.ops.zeros(shape, self.ops.kv_dtype)
                    for _ in range(config.num_hidden_layers)]
        v_caches = [self.ops.zeros(shape, self.ops.kv_dtype)
                    for _ in range(config.num_hidden_layers)]
        scratch_bytes = sum(int(c.nbytes) for c in k_caches + v_caches)
        positions = np.arange(num_tokens, dtype=np.int32)
        attn = build_attention_inputs(np.array([0, num_tokens], np.int32),
                                      np.array([num_tokens], np.int32),
                                      np.array([num_tokens], np.int32),
                                      np.arange(num_blocks, dtype=np.int32)[None, :])
        step = self.ops.step_inputs(positions, positions, attn)
        x, residual = self.model.forward(np.zeros(num_tokens, np.int32), step.positions,
                                         step.slot_mapping, step.attn, k_caches, v_caches)
        self.ops.to_host(self.model.logits(x[-1:], residual[-1:]))
        del x, residual, k_caches, v_caches, step
        return scratch_bytes

    def _move_blocks(self, out, virtual_engine: int = 0) -> None:
        """Swap out, swap in, then copy-on-write: the order docs/scheduler.md prescribes."""
        k_caches, v_caches, cpu_caches = self.kv_sets[virtual_engine]
        # [k_0, v_0, k_1, v_1, ...], the order `cpu_caches` mirrors for swaps.
        gpu_caches = [c for kv in zip(k_caches, v_caches) for c in kv]
        if len(out.swap_out):
            self.ops.swap_blocks(gpu_caches, cpu_caches, out.swap_out)
        if len(out.swap_in):
            self.ops.swap_blocks(cpu_caches, gpu_caches, out.swap_in)
        if len(out.block_copies):
            self.ops.copy_blocks(k_caches, v_caches, out.block_copies)

    def execute(self, out, prompt_logit_rows: tuple[int, ...] = (),
                row_lora_slots=None, token_source: TokenSource | None = None) -> RunnerOutput:
        """Run one scheduled step. `out` is a pagedrun.pyx.scheduler.SchedulerOutput;
        row_lora_slots: None, or int [num_reqs] each row's adapter slot (-1: none);
        token_source: input tokens still on the device (asynchronous scheduling)."""
        graphs = self.decode_graphs
        size = 0 if graphs is None else graphs.bucket(out, prompt_logit_rows, row_lora_slots)
        if size:
            self._move_blocks(out)
            logits = graphs.run(out, size, token_source)
            if not self.logits_on_device:
                logits = self.ops.to_host(logits)
            return RunnerOutput(np.arange(out.query_lens.shape[0]), logits, {})
        hidden = self.forward(out, row_lora_slots=row_lora_slots, token_source=token_source)
        return self.output(out, hidden, prompt_logit_rows)

    def forward(self, out, hidden=None, virtual_engine: int = 0, row_lora_slots=None,
                token_source: TokenSource | None = None):
        """The step's block moves, then this runner's layers over its tokens: (x, residual),
        each [num_tokens, hidden] (None for a step without tokens). hidden: a later pipeline
        stage's input, the previous stage's (x, residual); virtual_engine: whose KV pools;
        token_source: input tokens to take from a device array instead of out.input_token_ids
        (their host values are placeholders)."""
        self._move_blocks(out, virtual_engine)
        if out.num_batched_tokens == 0:
            return None
        k_caches, v_caches, _ = self.kv_sets[virtual_engine]
        drafts = (getattr(out, "num_draft_tokens", None)
                  if self.ops.capabilities.verify_as_decode_rows else None)
        attn = build_attention_inputs(out.query_start_loc, out.query_lens, out.context_lens,
                                      out.block_tables, drafts)
        # Uploaded once here, read by every layer (runtime/backends/step_inputs.py).
        step = self.ops.step_inputs(out.positions, out.slot_mapping, attn)
        token_ids = out.input_token_ids
        if token_source is not None:
            device = self.ops.to_device(np.array(token_ids, dtype=np.int32))  # a copy: patched
            token_source.scatter_into(self.ops, device)
            token_ids = DeviceInts(token_ids, device)
        return self.model.forward(token_ids, step.positions, step.slot_mapping,
                                  step.attn, k_caches, v_caches,
                                  lora=self._lora_step(out, row_lora_slots), hidden=hidden)

    def output(self, out, hidden, prompt_logit_rows: tuple[int, ...] = ()) -> RunnerOutput:
        """The logits of the rows that need them, from the last layer's (x, residual) (None:
        a step without tokens); on a tensor-parallel rank other than its group's first, the
        logits are its own vocabulary slice (unused)."""
        sample_rows = np.flatnonzero(out.sample_mask)
        if hidden is None:
            return RunnerOutput(sample_rows, np.empty((0, self.config.vocab_size), np.float32),
                                {})
        x, residual = hidden
        qsl = out.query_start_loc
        last_token = qsl[sample_rows + 1] - 1
        logits_start = None
        drafts = getattr(out, "num_draft_tokens", None)
        if drafts is not None and drafts.any():
            # A row verifying k drafts needs the logits of its last 1 + k query tokens.
            counts = drafts[sample_rows].astype(np.int64) + 1
            logits_start = np.concatenate(([0], np.cumsum(counts)))
            last_token = (np.repeat(last_token - counts + 1, counts)
                          + np.arange(int(logits_start[-1])) - np.repeat(logits_start[:-1],
                                                                         counts))
        if (logits_start is None and last_token.size == x.shape[0]
                and (last_token.size == 0 or int(last_token[-1]) == last_token.size - 1)):
            # Every token samples (a pure decode step): all rows, in order -- no gather copy.
            # (last_token is increasing: size n ending at n - 1 is 0 .. n - 1.)
            logits = self.model.logits(x, residual)
        else:
            logits = self.model.logits(x[last_token], residual[last_token])
        if not self.logits_on_device:
            logits = self.ops.to_host(logits)
        prompt_logits = {}
        for row in prompt_logit_rows:
            rows = slice(int(qsl[row]), int(qsl[row + 1]))
            prompt_logits[row] = self.ops.to_host(self.model.logits(x[rows], residual[rows]))
        return RunnerOutput(sample_rows, logits, prompt_logits, logits_start)
