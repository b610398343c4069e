"""HarnessRuntime: the device runtime of the CPU harness -- numpy arrays, kernels run on host
threads (cuda/sim via runtime/kernels/sim_module.py), graphs as recorded launch lists.

The kernel backend over this runtime is the sim device; over CupyRuntime it is cuda. It is as
strict as a GPU where being strict is cheap, so the shared code's capture faults fail in CI:
while a graph is captured, a synchronize, a write into a static buffer, an allocation outside
the graph pool (through `xp`), and a launch that does not go through `launch` (so the graph
would not hold it) each raise GraphCaptureError. (Host copies are not: here a host step's
operands and results are numpy arrays like any device array, and a host communicator's
collectives are such steps; the fake CuPy, tests/engine/fake_cupy.py, refuses them.)

Graphs (`SimGraph`): there is no driver to record for the harness, so while capturing, `launch`
runs each kernel and records it (function, grid, block, shared memory, the argument arrays
themselves), and `xp` is a recording numpy that records the copies and fills the backend makes
between launches (a GPU captures those as kernels). The graph holds every array it recorded, so
nothing it writes is reused, as the private pool guarantees on a GPU; replay re-issues the
record in order against the same arrays. Host work in the region that feeds a launch is baked
at capture, as on a GPU: the replay == eager tests catch such a region.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np

from pagedrun.runtime.kernels.loader import load_module

from .device_runtime import HostReady, LaunchModule
from .graph_capture import GraphCaptureError


class SimGraph:
    """The recorded launches and copies of a harness capture, replayed in order."""

    def __init__(self) -> None:
        self._ops: list = []
        self._arrays: dict[int, np.ndarray] = {}  # every array recorded, by id: kept alive
        self.num_launches = 0

    def _keep(self, *arrays) -> None:
        for a in arrays:
            if isinstance(a, np.ndarray):
                self._arrays[id(a)] = a

    def record_launch(self, fn, grid, block, args: tuple, shared_mem: int) -> None:
        self._keep(*args)
        self._ops.append(partial(fn, grid, block, args, shared_mem=shared_mem))
        self.num_launches += 1

    def record_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._keep(dst, src)
        self._ops.append(partial(np.copyto, dst, src, casting="unsafe"))

    def record_fill(self, dst: np.ndarray, value) -> None:
        self._keep(dst)
        self._ops.append(partial(dst.fill, value))

    def record_host_call(self, fn, args: tuple, out: np.ndarray) -> None:
        """A host step between launches (a collective over a host communicator): replayed as
        fn(*args) again, on the same arrays, its result written into `out`."""
        self._keep(*args, out)
        self._ops.append(lambda: np.copyto(out, fn(*args), casting="no"))

    def replay(self) -> None:
        for op in self._ops:
            op()

    def memory_bytes(self, exclude=()) -> int:
        """Bytes of the distinct buffers the graph holds (views counted by their base), less
        the buffers in `exclude` (weights, KV pools: not the graph's own)."""
        skip = {id(_base(a)) for a in exclude}
        bases = {id(b): b.nbytes for b in map(_base, self._arrays.values())
                 if id(b) not in skip}
        return sum(bases.values())


def _base(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class RecordingNumpy:
    """numpy for the backend while a harness graph captures: the copies and fills it makes are
    recorded (a GPU captures them as kernels), and every allocation must come from the graph
    pool; every other name is numpy's own."""

    def __init__(self, runtime: "HarnessRuntime", graph: SimGraph) -> None:
        self._runtime = runtime
        self._graph = graph

    def ascontiguousarray(self, a, dtype=None):
        out = np.ascontiguousarray(a, dtype=dtype)
        if isinstance(a, np.ndarray) and not np.may_share_memory(out, a):
            self._runtime.check_allocation("ascontiguousarray")
            self._graph.record_copy(out, a)
        return out

    def empty(self, shape, dtype=float):
        self._runtime.check_allocation("empty")
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype=float):
        self._runtime.check_allocation("zeros")
        out = np.zeros(shape, dtype)
        self._graph.record_fill(out, 0)
        return out

    def zeros_like(self, a, dtype=None):
        self._runtime.check_allocation("zeros_like")
        out = np.zeros_like(a, dtype=dtype)
        self._graph.record_fill(out, 0)
        return out

    def __getattr__(self, name: str):
        return getattr(np, name)


class _HarnessPool:
    """A private pool's stand-in: the harness allocates from numpy; what matters is that the
    capture allocates while the pool is in use (`use_pool`)."""


class _GuardedFunction:
    """A harness kernel that refuses a launch made around the runtime while it captures (the
    graph would not hold it: on a GPU, a launch on another stream than the captured one)."""

    __slots__ = ("_fn", "_runtime")

    def __init__(self, fn, runtime: "HarnessRuntime") -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_runtime", runtime)

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        runtime = self._runtime
        if runtime._graph is not None and not runtime._launching:
            raise GraphCaptureError(f"kernel {self._fn.name} launched under capture without "
                                    "going through the runtime: the graph would not hold it")
        return self._fn(grid, block, args, shared_mem=shared_mem, stream=stream)

    def __getattr__(self, name: str):
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._fn, name, value)


class _GuardedModule:
    def __init__(self, module, runtime: "HarnessRuntime") -> None:
        self._module = module
        self._runtime = runtime

    def get_function(self, name: str) -> _GuardedFunction:
        return _GuardedFunction(self._module.get_function(name), self._runtime)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class HarnessRuntime:
    """numpy arrays, kernels on CPU threads, recorded graphs (the module docstring)."""

    name = "sim"
    communicator = "cpu"  # tensor-parallel ranks all-reduce over the host (ZeroMQ) communicator
    stream = None
    # Each capture runs a forward on CPU threads: graphs only where a test or the config asks.
    graphs_by_default = False

    def __init__(self) -> None:
        self.xp = np
        self._graph: SimGraph | None = None
        self._pool: _HarnessPool | None = None
        self._launching = False

    # ------------------------------------------------------------------ kernels
    def load_module(self, sources: list[str]) -> LaunchModule:
        return LaunchModule(_GuardedModule(load_module(sources, backend="sim"), self), self)

    def launch(self, fn, grid, block, args: tuple, shared_mem: int) -> None:
        self._launching = True
        try:
            fn(grid, block, args, shared_mem=shared_mem)
        finally:
            self._launching = False
        if self._graph is not None:
            self._graph.record_launch(fn, grid, block, args, shared_mem)

    # ------------------------------------------------------------------ memory and copies
    def _refuse_in_capture(self, what: str) -> None:
        if self._graph is not None:
            raise GraphCaptureError(f"{what} inside a captured region: a GPU cannot capture it "
                                    "(it waits for the stream)")

    def check_allocation(self, what: str) -> None:
        """An allocation while capturing must come from the graph pool: the replays write
        the addresses the capture saw, which must belong to nothing else."""
        if self._graph is not None and self._pool is None:
            raise GraphCaptureError(f"{what}: an allocation outside the graph pool during "
                                    "capture (a replay would write memory the default pool "
                                    "hands to others)")

    def upload(self, host: np.ndarray) -> np.ndarray:
        # Not refused while capturing: host and device arrays are both numpy here, so the
        # result of a recorded host step (a host communicator's) arrives as a "host" array.
        # The fake CuPy (tests/engine/fake_cupy.py) refuses a real upload under capture.
        return np.ascontiguousarray(host)

    def upload_into(self, dst: np.ndarray, host: np.ndarray) -> None:
        self._refuse_in_capture("a host-to-device copy")
        np.copyto(dst, host)

    def to_host(self, x) -> np.ndarray:
        return x  # not refused while capturing: a host step's operand is a numpy array too

    def download_async(self, x):
        return HostReady(x)

    def synchronize(self) -> None:
        self._refuse_in_capture("a host synchronize")

    def memory_info(self):
        return None  # host memory: the fixed host budget (KernelBackend.kv_cache_budget_bytes)

    def reserved_bytes(self) -> int:
        return 0

    def release_cached(self) -> None:
        pass

    # ------------------------------------------------------------------ graphs
    def new_pool(self) -> _HarnessPool:
        return _HarnessPool()

    @contextmanager
    def use_pool(self, pool: _HarnessPool):
        outer, self._pool = self._pool, pool
        try:
            yield
        finally:
            self._pool = outer

    def pool_bytes(self, pool) -> int:
        del pool
        return 0

    def is_capturing(self) -> bool:
        return self._graph is not None

    def begin_capture(self) -> None:
        if self._graph is not None:
            raise GraphCaptureError("a capture is already in progress on this runtime")
        self._graph = SimGraph()
        self.xp = RecordingNumpy(self, self._graph)

    def end_capture(self) -> SimGraph:
        graph, self._graph, self.xp = self._graph, None, np
        return graph

    def abort_capture(self) -> None:
        self._graph, self.xp = None, np

    def instantiate(self, graph: SimGraph) -> None:
        del graph

    def replay(self, graph: SimGraph) -> None:
        graph.replay()

    def graph_launches(self, graph: SimGraph) -> int:
        return graph.num_launches

    def graph_bytes(self, graph: SimGraph, exclude=()) -> int:
        return graph.memory_bytes(exclude)

    def graph_output(self, array, pool):
        del pool
        return array  # the SimGraph holds it

    def array_op(self, fn, args: tuple):
        """fn(*args): array-module work between launches (a GPU captures it as kernels; here
        it is recorded as a host step, else a replay would keep the capture's values)."""
        return self.host_call(fn, args)

    def host_call(self, fn, args: tuple):
        out = fn(*args)
        if self._graph is not None:
            self._graph.record_host_call(fn, args, out)
        return out

