"""CudaBackend: the model's ops on a GPU -- CuPy arrays, cuda/*.cu through cupy.RawModule, no
torch, no cuBLAS on the hot path (CuPy's matmul is only the benchmarks' baseline).

The ops are KernelBackend's (runtime/backends/sim_backend.py), the very code the sim backend
runs under the CPU harness; only the array module and the module loader differ. This module
adds what only a GPU has: the device check, the stream every launch goes to, and the KV budget
from `gpu_memory_utilization`:

    budget = utilization x total - memory in use before - weights - peak of a max-size step

(`CudaBackend.kv_cache_budget_bytes` measures around the runner's `profile_run`, the module's
`kv_cache_budget_bytes` is the arithmetic; the engine turns the budget into blocks and logs
the capacity in tokens).
Importing this module never imports cupy; constructing a CudaBackend does.
"""
from __future__ import annotations

import logging

from pagedrun.runtime.errors import PagedRunError

from .cuda_probe import cuda_available
from .graph_capture import cuda_graph_capture
from .sim_backend import KernelBackend

log = logging.getLogger("pagedrun.cuda")
# Largest decode batch captured by default (vLLM's default capture cap is 512 too): past it a
# step's launches are a small part of its time.
MAX_GRAPH_BATCH = 512


class CudaNotAvailableError(RuntimeError):
    """CuPy is missing or sees no GPU."""


class CudaBackend(KernelBackend):
    name = "cuda"
    loader_backend = "cuda"
    communicator = "nccl"  # tensor-parallel ranks all-reduce over NCCL on the compute stream

    def __init__(self, dtype_name: str = "bfloat16", device_id: int = 0, *,
                 kv_cache_dtype: str = "auto", quantization: str | None = None) -> None:
        if not cuda_available():
            raise CudaNotAvailableError("the cuda backend needs CuPy and a visible GPU "
                                        "(pip install cupy-cuda12x; check nvidia-smi)")
        import cupy

        super().__init__(dtype_name, cupy, kv_cache_dtype=kv_cache_dtype,
                         quantization=quantization)
        self.device_id = device_id
        cupy.cuda.Device(device_id).use()
        # One non-default stream for the step: launches queue behind each other without the
        # legacy default stream's implicit syncs with other host threads' work.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        # Every graph's allocations (graph_capture): private, so a replay's buffers are never
        # handed to anything else.
        self.graph_pool = None

    # ------------------------------------------------------------------ graphs
    def default_graph_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """1, 2, 4, then every 8 up to min(max_num_seqs, MAX_GRAPH_BATCH): a decode batch runs
        in the smallest size that holds it (at most 7 padded rows past 8)."""
        cap = min(max_num_seqs, MAX_GRAPH_BATCH)
        return tuple(s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap)

    def graph_capture(self):
        """CuPy stream capture of the backend's stream into a cupy.cuda.Graph
        (runtime/backends/graph_capture.py)."""
        return cuda_graph_capture(self)

    def upload_into(self, dst, host) -> None:
        # cupy.asarray stages a host array through pinned memory and copies asynchronously
        # (a copy from pageable memory may wait for the stream's earlier work, which would
        # undo asynchronous scheduling); one small device-to-device copy into the static buffer.
        dst[...] = self.xp.asarray(host)

    def graph_output(self, array):
        """A view of a captured graph's output that does not own its memory: the buffer goes
        back to the private graph pool, where later captures reuse it. Sound because replays
        run one at a time on the one stream and each output is consumed (the sampler copies
        the logits) before the next replay; it keeps the graphs' memory near the largest
        size's, where owned outputs would hold [size, vocab] float32 for every size (GBs for
        a 128k vocabulary)."""
        cupy = self.xp
        if not array.flags.c_contiguous:
            raise ValueError("graph_output: the graph's output must be C-contiguous")
        memory = cupy.cuda.UnownedMemory(array.data.ptr, array.nbytes, self.graph_pool)
        return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))

    def graph_memory_bytes(self, graphs, exclude=()) -> int:
        """The private graph pool's bytes (weights and KV pools live outside it)."""
        del graphs, exclude
        return 0 if self.graph_pool is None else int(self.graph_pool.total_bytes())

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        free, total = self.xp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def kv_cache_budget_bytes(self, profile, *, gpu_memory_utilization: float) -> int:
        """KV bytes for the engine, measured around `profile` (ModelRunner.profile_run: one
        maximum-size step of the runner's own model on a scratch KV pool): the weights it
        placed and the activation peak, then kv_cache_budget_bytes(...) of what was measured.

        profile None (a tensor-parallel rank cannot run its shard alone: the collectives need
        every rank) raises: give num_kv_blocks or kv_cache_memory_bytes per rank."""
        if profile is None:
            raise PagedRunError("cuda: the KV budget is measured by running the model on this "
                                "GPU, which a tensor-parallel shard cannot do alone; give "
                                "num_kv_blocks (--num-kv-blocks) or kv_cache_memory_bytes, "
                                "per rank")
        pool = self.xp.get_default_memory_pool()
        pool.free_all_blocks()
        free_before, total = self.memory_info()
        reserved_before = pool.total_bytes()
        weights_before = self.placed_weight_bytes()  # already counted in free_before
        scratch_kv_bytes = profile()
        self.stream.synchronize()
        new_weights_bytes = self.placed_weight_bytes() - weights_before
        step_bytes = pool.total_bytes() - reserved_before
        activation_peak = max(0, step_bytes - new_weights_bytes - scratch_kv_bytes)
        pool.free_all_blocks()  # the scratch pool and activations; the weights stay placed
        return kv_cache_budget_bytes(total, total - free_before, new_weights_bytes,
                                     activation_peak, gpu_memory_utilization)

    def placed_weight_bytes(self) -> int:
        """Bytes of the weights this backend has placed on the device so far."""
        return sum(int(dev.nbytes) for _, dev in self._weights.values())


def kv_cache_budget_bytes(total_bytes: int, used_before_bytes: int, weights_bytes: int,
                          activation_peak_bytes: int, gpu_memory_utilization: float) -> int:
    """utilization x total, minus what was in use before the engine (CUDA context, other
    processes), the weights and the activation peak of a maximum-size step; never negative."""
    budget = (int(gpu_memory_utilization * total_bytes) - used_before_bytes - weights_bytes
              - activation_peak_bytes)
    log.info("GPU memory: %.2f GiB total, utilization %.2f, in use before %.2f GiB, weights "
             "%.2f GiB, step peak %.2f GiB -> KV budget %.2f GiB", total_bytes / 2**30,
             gpu_memory_utilization, used_before_bytes / 2**30, weights_bytes / 2**30,
             activation_peak_bytes / 2**30, max(budget, 0) / 2**30)
    return max(budget, 0)
