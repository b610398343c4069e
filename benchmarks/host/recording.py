"""RecordingBackend: the cuda backend's code over a stand-in for CuPy's RawModule that records
every kernel launch and runs none.

    backend = RecordingBackend("bfloat16", vocab_size, num_sms=132)
    ... engine steps ...
    backend.launches.take()   # -> (launches, argument bytes, {kernel: launches}) since last take

The ops are KernelBackend's (runtime/backends/kernel_backend.py), the code the cuda backend runs,
on numpy arrays standing in for device memory: every launch wrapper in runtime/kernels/ plans,
checks and allocates as it does on a GPU, then calls `RecordingFunction`, which only counts the
launch and the bytes of its kernel arguments as CuPy passes them (8 per array or NULL, a
device pointer; a numpy scalar's itemsize). What it leaves out: CuPy's own kernels (fancy indexing,
`ascontiguousarray` of a strided view, `astype`), which are not RawModule launches, and the
host-to-device copies of step metadata, which numpy does not make.

Nothing is computed, so activations and logits are whatever the allocation held; the one
output the host reads back, the sampling kernel's token ids, is filled with fixed valid ids
(`SAMPLED_TOKEN_KERNEL`), so the engine's postprocessing sees real tokens.

Launch plans depend on the device's multiprocessor count (decode split-KV partitions, split-K
GEMMs): `num_sms` sets the count the wrappers plan for (runtime.kernels.kernel_args.SIM_NUM_SMS,
which is what they ask under numpy), restored by `close()`.
"""
from __future__ import annotations

import time
from collections import Counter

import numpy as np

from pagedrun.runtime.backends.device_runtime import LaunchModule
from pagedrun.runtime.backends.harness_runtime import HarnessRuntime
from pagedrun.runtime.backends.kernel_backend import KernelBackend
from pagedrun.runtime.kernels import kernel_args

# Bytes CuPy passes for an array argument: its device pointer.
POINTER_BYTES = 8
# The kernel whose first argument (out [rows] int32) is read back by the host: the sampled ids.
SAMPLED_TOKEN_KERNEL = "sample_f32"
# Low ids are special tokens in most vocabularies; sampled ids are drawn above them.
FIRST_PLAIN_TOKEN_ID = 100
SAMPLED_TOKENS_SEED = 0


# The name a decode graph's replay is counted under (one cudaGraphLaunch).
GRAPH_LAUNCH = "cudaGraphLaunch"


class LaunchLog:
    """Launches and kernel-argument bytes recorded since the last `take`; while `capturing`,
    launches are counted into `captured` instead (a graph capture issues nothing)."""

    def __init__(self) -> None:
        self.num_launches = 0
        self.arg_bytes = 0
        self.by_kernel: Counter[str] = Counter()
        self.capturing = False
        self.captured = 0

    def record(self, name: str, args: tuple) -> None:
        if self.capturing:
            self.captured += 1
            return
        self.num_launches += 1
        self.by_kernel[name] += 1
        # None: a NULL pointer under numpy (CuPy gets an 8-byte np.uint64(0) there instead).
        self.arg_bytes += sum(a.itemsize if isinstance(a, np.generic) else POINTER_BYTES
                              for a in args)

    def take(self) -> tuple[int, int, Counter]:
        taken = (self.num_launches, self.arg_bytes, self.by_kernel)
        self.num_launches, self.arg_bytes, self.by_kernel = 0, 0, Counter()
        return taken


class RecordingFunction:
    """A kernel of RecordingModule: fn(grid, block, args, shared_mem=0) records, runs nothing."""

    def __init__(self, name: str, log: LaunchLog, fill_tokens: np.ndarray) -> None:
        self.name = name
        self.log = log
        self.fill_tokens = fill_tokens
        self.max_dynamic_shared_size_bytes = 0  # set by wrappers as on cupy.RawKernel

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        del grid, block, shared_mem, stream
        args = tuple(args)
        self.log.record(self.name, args)
        if self.name == SAMPLED_TOKEN_KERNEL:
            out = args[0]
            out[:] = self.fill_tokens[:out.shape[0]]


class RecordingModule:
    """cupy.RawModule's get_function surface; every function records into one LaunchLog."""

    def __init__(self, log: LaunchLog, fill_tokens: np.ndarray) -> None:
        self.log = log
        self.fill_tokens = fill_tokens
        self._functions: dict[str, RecordingFunction] = {}

    def get_function(self, name: str) -> RecordingFunction:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = RecordingFunction(name, self.log, self.fill_tokens)
        return fn


class RecordingRuntime(HarnessRuntime):
    """The harness runtime with RecordingModules in place of the kernel modules, and a graph
    capture as the driver sees it: the region's launches are recorded once (not counted per
    step) and each replay is one GRAPH_LAUNCH, as cudaGraphLaunch is; nothing runs either way
    (runtime/decode_graphs.py and runtime/backends/graph_capture.py drive it as on cuda)."""

    name = "cuda-recording"

    def __init__(self, launches: LaunchLog, fill_tokens: np.ndarray) -> None:
        super().__init__()
        self.launches = launches
        self._fill_tokens = fill_tokens

    def load_module(self, sources):
        del sources
        return LaunchModule(RecordingModule(self.launches, self._fill_tokens), self)

    def launch(self, fn, grid, block, args: tuple, shared_mem: int) -> None:
        fn(grid, block, args, shared_mem=shared_mem)

    def synchronize(self) -> None:
        pass

    def begin_capture(self) -> None:
        self.launches.capturing, self.launches.captured = True, 0

    def end_capture(self) -> int:
        self.launches.capturing = False
        return self.launches.captured

    def abort_capture(self) -> None:
        self.launches.capturing = False

    def is_capturing(self) -> bool:
        return self.launches.capturing

    def replay(self, graph) -> None:
        self.launches.record(GRAPH_LAUNCH, ())

    def graph_launches(self, graph: int) -> int:
        return graph

    def graph_bytes(self, graph, exclude=()) -> int:
        return 0  # nothing is allocated for real


class RecordingBackend(KernelBackend):
    """KernelBackend over the recording runtime; `launches` is its LaunchLog."""

    def __init__(self, dtype_name: str, vocab_size: int, *, num_sms: int,
                 max_rows: int = 4096) -> None:
        rng = np.random.default_rng(SAMPLED_TOKENS_SEED)
        fill = rng.integers(min(FIRST_PLAIN_TOKEN_ID, vocab_size // 2), vocab_size, max_rows)
        self.launches = LaunchLog()
        super().__init__(RecordingRuntime(self.launches, fill.astype(np.int32)), dtype_name)
        self._saved_num_sms = kernel_args.SIM_NUM_SMS
        kernel_args.SIM_NUM_SMS = num_sms  # what the wrappers plan for under numpy

    def close(self) -> None:
        kernel_args.SIM_NUM_SMS = self._saved_num_sms


def recording_ns_per_launch(calls: int = 20000) -> float:
    """Nanoseconds one RecordingFunction call costs (a GEMM's 11 arguments): the stand-in's
    own share of the "launches" phase, which a real CuPy launch replaces with its own cost."""
    fn = RecordingFunction("gemm", LaunchLog(), np.zeros(1, np.int32))
    a = np.zeros(1, np.float32)
    args = (a, None, a, a, None, None, np.int32(1), np.int32(1), np.int32(1), np.int32(1))
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn((1, 1, 1), (128,), args, shared_mem=0)
    return (time.perf_counter_ns() - start) / calls
