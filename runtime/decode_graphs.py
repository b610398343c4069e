"""DecodeGraphs: pure-decode steps replayed from graphs captured per batch size (CUDA graphs).

A decode step of a small model is a few hundred microseconds of kernels and ~270 launches (30
layers x 9 kernels); issued one by one from Python the host is the bottleneck. So the whole
decode forward and LM head are captured once per batch size in `sizes` (the backend's
graph_capture: CuPy stream capture on cuda, the recorded launch list on the sim harness) and a
step is one graph launch:

  static inputs   one int32 device buffer, segments of `capacity` (= the largest size) rows:
                  token_ids [cap] | positions [cap] | slot_mapping [cap] | context_lens [cap] |
                  block_tables [cap, max_blocks]; the graph of size b reads the first b rows
                  of each. A step fills a host copy and uploads it in one copy.
  padding         rows n..b-1 of a batch of n in size b: token 0, position 0, slot -1 (the
                  cache write skips it), context 1 over block 0 of an all-zero table row. Their
                  results are garbage by design and never read: every kernel of the forward
                  works row by row, and only logits[:n] is returned.
  attention plan  captured for the longest context (max_model_len): the decode kernel's split
                  plan (grid) is fixed in a graph, and a shorter context leaves later splits
                  empty (they write nothing the merge counts).
  outputs         each graph's logits [b, vocab] float32 (`ops.graph_output`): on cuda a view
                  that does not own its buffer, which stays in the private graph pool where
                  the smaller sizes' captures reuse it (replays run one at a time and the
                  sampler copies the logits before the next), so the graphs take about the
                  largest size's memory, not [size, vocab] per size; eager steps never get it.

A step replays only when it is pure decode (every row one query token, no drafts to verify),
every row samples, no row has a LoRA adapter and no prompt logits are asked for, and its batch
fits the largest size; anything else runs eagerly (`bucket` says which). The KV pools are bound
at capture: allocating new pools means capturing again (ModelRunner drops the graphs).
Models with ops that leave the device mid-forward (mixture-of-experts routing, Gemma's embedding
scale), sliding windows or act-order int4 weights are not captured: the model says so
(`graph_capture_refusal()`, runtime/models/llama.py), the runner asks it.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from pagedrun.runtime.backends.step_inputs import DeviceInts
from pagedrun.runtime.models.llama import AttentionInputs

log = logging.getLogger("pagedrun.graphs")

_PAD_SLOT = -1        # rotary_cache_write.cu: a negative slot writes nothing
_PAD_CONTEXT = 1      # one key, in block 0 (rows of padding read and write nothing real)


def graph_sizes(config, backend) -> tuple[int, ...]:
    """The decode batch sizes an engine with EngineConfig `config` captures on `backend`:
    none with enforce_eager or a backend without graphs; else cuda_graph_sizes, or the
    backend's default, without the sizes above max_num_seqs."""
    if config.enforce_eager or not backend.capabilities.graphs:
        return ()
    sizes = config.cuda_graph_sizes
    if sizes is None:
        sizes = backend.default_graph_sizes(config.max_num_seqs)
    return tuple(s for s in sizes if s <= config.max_num_seqs)


class DecodeGraphs:
    """Captured decode forwards of `model` over `k_caches`/`v_caches`, one per batch size."""

    def __init__(self, model, ops, k_caches: list, v_caches: list, *, sizes, max_model_len: int,
                 block_size: int) -> None:
        sizes = sorted({int(s) for s in sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"graph sizes must be positive batch sizes, got {sizes}")
        self.model, self.ops = model, ops
        self.k_caches, self.v_caches = k_caches, v_caches
        self.sizes = tuple(sizes)
        self.capacity = cap = sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        # Host staging and its device twin: token_ids | positions | slot_mapping |
        # context_lens | block_tables (module docstring).
        self._host = np.zeros(4 * cap + cap * self.max_blocks, np.int32)
        self._device = ops.zeros(self._host.shape, np.int32)
        self._host_segments = self._segments(self._host)
        self._device_segments = self._segments(self._device)
        self._graphs: dict[int, tuple[object, object]] = {}  # size -> (CapturedGraph, logits)
        self._bucket_of = np.searchsorted(np.asarray(self.sizes), np.arange(cap + 1))
        self.capture_seconds = 0.0
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # size -> steps replayed

    def _segments(self, buffer) -> tuple:
        cap, w = self.capacity, self.max_blocks
        return (buffer[0:cap], buffer[cap:2 * cap], buffer[2 * cap:3 * cap],
                buffer[3 * cap:4 * cap], buffer[4 * cap:].reshape(cap, w))

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Capture every size, the largest first (its buffers then serve the smaller ones
        from the backend's graph pool). Each size runs once eagerly first: weights placed,
        modules built and every kernel of it loaded before the stream is captured."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._fill_padding(0, size)
            self._upload(size)
            self._forward(size)  # warm-up
            with self.ops.graph_capture() as captured:
                logits = self._forward(size)
            self._graphs[size] = (captured, self.ops.graph_output(logits))
            del logits  # cuda: its buffer returns to the graph pool (graph_output)
        self.capture_seconds = time.perf_counter() - start
        launches = self._graphs[self.sizes[0]][0].num_launches
        log.info("decode graphs: sizes %s captured in %.2f s, graph memory %.1f MiB%s",
                 ",".join(map(str, self.sizes)), self.capture_seconds,
                 self.memory_bytes() / 2**20,
                 "" if launches is None else
                 f", {launches} kernel launches replayed as one (size {self.sizes[0]})")

    def memory_bytes(self) -> int:
        """Device bytes the graphs hold (private pool on cuda; recorded buffers on sim), plus
        the static inputs."""
        graphs = [g for g, _ in self._graphs.values()]
        own = self.ops.graph_memory_bytes(graphs, exclude=[*self.k_caches, *self.v_caches,
                                                           self._device])
        return int(own) + int(self._device.nbytes)

    def _forward(self, size: int):
        """The decode forward and LM head of the first `size` static rows (eager unless a
        capture is open)."""
        tokens, positions, slots, context, tables = self._device_segments
        host_tables = np.zeros((size, self.max_blocks), np.int32)
        # The host lengths only size the attention plan: the longest context a replay may see.
        host_context = np.full(size, self.max_model_len, np.int32)
        attn = AttentionInputs(
            decode_token_rows=slice(0, size),
            decode_block_tables=DeviceInts(host_tables, tables[:size]),
            decode_context_lens=DeviceInts(host_context, context[:size]),
            prefill_token_rows=slice(0, 0),
            prefill_block_tables=np.zeros((0, self.max_blocks), np.int32),
            prefill_query_start_loc=np.zeros(1, np.int32),
            prefill_context_lens=np.zeros(0, np.int32),
            num_decode=size, num_prefill=0)
        dummy = np.zeros(size, np.int32)
        x, residual = self.model.forward(
            DeviceInts(dummy, tokens[:size]), DeviceInts(dummy, positions[:size]),
            DeviceInts(dummy, slots[:size]), attn, self.k_caches, self.v_caches)
        # Contiguous (a copy inside the graph where it is not, e.g. a tensor-parallel rank 0's
        # vocabulary-trimmed gather): the output is kept as a plain buffer (graph_output).
        return self.ops.xp.ascontiguousarray(self.model.logits(x, residual))

    # ------------------------------------------------------------------ replay
    def bucket(self, out, prompt_logit_rows=(), row_lora_slots=None) -> int:
        """The size whose graph runs step `out` (a SchedulerOutput, or a tensor-parallel
        worker's StepInputs: the same fields), or 0: run it eagerly."""
        n = out.query_lens.shape[0]
        if n == 0 or n > self.capacity or out.num_batched_tokens != n or prompt_logit_rows:
            return 0
        drafts = getattr(out, "num_draft_tokens", None)
        if drafts is not None and drafts.any():
            return 0
        if row_lora_slots is not None and (np.asarray(row_lora_slots) >= 0).any():
            return 0
        if not out.sample_mask.all():
            return 0
        return self.sizes[self._bucket_of[n]]

    def run(self, out, size: int, token_source=None):
        """Replay the graph of `size` on step `out`'s inputs: logits [num_reqs, vocab] float32
        (a view of the graph's output: valid until the next replay). token_source: input
        tokens taken from a device array (model_runner.TokenSource), written into the static
        token buffer after the upload."""
        n = out.query_lens.shape[0]
        tokens, positions, slots, context, tables = self._host_segments
        tokens[:n] = out.input_token_ids
        positions[:n] = out.positions
        slots[:n] = out.slot_mapping
        context[:n] = out.context_lens
        width = out.block_tables.shape[1]
        tables[:n, :width] = out.block_tables
        tables[:n, width:] = 0
        self._fill_padding(n, size)
        self._upload(size)
        if token_source is not None:
            token_source.scatter_into(self.ops, self._device_segments[0])
        captured, logits = self._graphs[size]
        captured.replay()
        self.replays[size] += 1
        return logits[:n]

    def _fill_padding(self, first: int, size: int) -> None:
        tokens, positions, slots, context, tables = self._host_segments
        tokens[first:size] = 0
        positions[first:size] = 0
        slots[first:size] = _PAD_SLOT
        context[first:size] = _PAD_CONTEXT
        tables[first:size] = 0

    def _upload(self, size: int) -> None:
        """One copy: the four row segments whole and the first `size` block-table rows."""
        end = 4 * self.capacity + size * self.max_blocks
        self.ops.upload_into(self._device[:end], self._host[:end])
