"""Graph capture for the kernel backends: a region of launches recorded once, replayed as one.

    with backend.graph_capture() as captured:     # KernelBackend / CudaBackend.graph_capture
        logits = model.logits(*model.forward(...))  # launches on static input buffers
    captured.replay()                              # the same launches, the same buffers

cuda (`cuda_graph_capture`): CuPy stream capture of the backend's stream (relaxed mode, CuPy's
default, so the memory pool may grow while capturing) into a cupy.cuda.Graph, replayed with one
graph launch. Every allocation made while capturing comes from one private memory pool, shared
by all of the backend's graphs and never handed back to the default pool: a replay writes the
addresses the capture saw, which must belong to nothing else. Graphs replay one at a time on
the one stream, so they share the pool's buffers, outputs included (CudaBackend.graph_output:
each output is consumed before the next replay).

sim (`SimGraph`): the harness has no driver to record for it, so the backend hands out recording
proxies while capturing: each kernel launch runs and is recorded (the function, grid, block,
shared memory and the argument arrays themselves), and so is each copy the backend's array
module makes between launches (`xp.ascontiguousarray` of a strided view, `xp.zeros` fills).
The graph holds every array it recorded, so like the private pool nothing it writes is reused;
replay re-issues the record in order against the same arrays. The code between begin and end is
the cuda path's, so CI proves the capture/replay logic (static buffers, padding, what a replay
must re-read). Host work in the region that feeds a launch is baked at capture, as on a GPU,
where it is not captured at all: the replay == eager tests catch such a region.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np


class GraphCaptureError(RuntimeError):
    """A region could not be captured (the message says what in it cannot be)."""


class SimGraph:
    """The recorded launches and copies of a sim capture, replayed in order."""

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


class RecordingFunction:
    """A harness kernel function that records each launch in `graph` and then runs it.

    Attribute reads and writes (max_dynamic_shared_size_bytes, ...) go to the real function."""

    def __init__(self, fn, graph: SimGraph) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_graph", graph)

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        del stream
        args = tuple(args)
        self._fn(grid, block, args, shared_mem=shared_mem)
        self._graph.record_launch(self._fn, grid, block, args, shared_mem)

    def __getattr__(self, name: str):
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._fn, name, value)


class RecordingModule:
    """A SimModule whose functions record their launches in `graph`."""

    def __init__(self, module, graph: SimGraph) -> None:
        self._module = module
        self._graph = graph

    def get_function(self, name: str) -> RecordingFunction:
        return RecordingFunction(self._module.get_function(name), self._graph)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class RecordingNumpy:
    """numpy for the backend while a sim graph captures: the copies and fills it makes are
    recorded (a GPU captures them as kernels); every other name is numpy's own."""

    def __init__(self, graph: SimGraph) -> None:
        self._graph = graph

    def ascontiguousarray(self, a, dtype=None):
        out = np.ascontiguousarray(a, dtype=dtype)
        if isinstance(a, np.ndarray) and not np.may_share_memory(out, a):
            self._graph.record_copy(out, a)
        return out

    def zeros(self, shape, dtype=float):
        out = np.zeros(shape, dtype)
        self._graph.record_fill(out, 0)
        return out

    def zeros_like(self, a, dtype=None):
        out = np.zeros_like(a, dtype=dtype)
        self._graph.record_fill(out, 0)
        return out

    def __getattr__(self, name: str):
        return getattr(np, name)


class CapturedGraph:
    """One captured region: `replay()` re-runs it; `num_launches` (sim: the kernels recorded;
    cuda: None, the driver's graph holds them) and `memory_bytes` for the start-up log."""

    def __init__(self) -> None:
        self._replay = None
        self.num_launches: int | None = None
        self.graph = None  # SimGraph or cupy.cuda.Graph

    def replay(self) -> None:
        if self._replay is None:
            raise GraphCaptureError("the graph is replayed before its capture ended")
        self._replay()


@contextmanager
def sim_graph_capture(backend):
    """Capture on a KernelBackend over numpy (the harness): recording modules and numpy."""
    if backend._capturing is not None:
        raise GraphCaptureError("a capture is already in progress on this backend")
    graph = SimGraph()
    captured = CapturedGraph()
    xp = backend.xp
    backend._capturing, backend.xp = graph, RecordingNumpy(graph)
    try:
        yield captured
    finally:
        backend._capturing, backend.xp = None, xp
    captured.graph, captured._replay = graph, graph.replay
    captured.num_launches = graph.num_launches


@contextmanager
def cuda_graph_capture(backend):
    """Capture on a CudaBackend's stream into a cupy.cuda.Graph, allocating from its private
    graph pool (created on the first capture)."""
    cupy = backend.xp
    if backend._capturing is not None:
        raise GraphCaptureError("a capture is already in progress on this backend")
    if backend.graph_pool is None:
        backend.graph_pool = cupy.cuda.MemoryPool()
    stream = backend.stream
    stream.synchronize()  # nothing eager may be in flight into the capture
    captured = CapturedGraph()
    backend._capturing = captured
    try:
        with cupy.cuda.using_allocator(backend.graph_pool.malloc):
            stream.begin_capture()
            try:
                yield captured
            except BaseException:
                try:
                    stream.end_capture()  # leave the stream usable; the graph is dropped
                except Exception:  # noqa: BLE001 -- an invalidated capture may refuse to end
                    pass
                raise
            graph = stream.end_capture()
    finally:
        backend._capturing = None
    if hasattr(graph, "upload"):  # CuPy >= 13: instantiate on the device now, not at replay 1
        graph.upload(stream)
    captured.graph = graph
    captured._replay = partial(graph.launch, stream)
