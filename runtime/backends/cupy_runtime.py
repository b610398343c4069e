"""CupyRuntime: the device runtime on a GPU, through CuPy -- the only code of the cuda backend
that CI cannot execute, kept to the primitives of runtime/backends/device_runtime.py.

tests/engine/test_cupy_runtime.py drives every function here against a strict fake of CuPy 14
(tests/engine/fake_cupy.py) that raises wherever CuPy or the driver would, and runs whole
engines -- decode graphs, asynchronous scheduling, the KV budget -- over it.

One non-default stream carries every launch and copy: launches queue behind each other without
the legacy default stream's implicit syncs with other host threads' work. CuPy's current stream
is per host thread, so `launch` makes it current on whichever thread launches (the engine may
step on another thread than the one that built the backend); a capture records that stream only.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from pagedrun.runtime.kernels.loader import load_module

from .device_runtime import LaunchModule
from .graph_capture import GraphCaptureError


class CupyRuntime:
    name = "cuda"
    communicator = "nccl"  # tensor-parallel ranks all-reduce over NCCL on the compute stream
    graphs_by_default = True  # decode steps replay graphs unless the config says eager

    def __init__(self, device_id: int = 0, cupy=None, cupyx=None) -> None:
        """cupy, cupyx: the modules (tests pass their fakes); imported here when None."""
        if cupy is None:
            import cupy
            import cupyx
        self.cupy = self.xp = cupy
        self.cupyx = cupyx
        self.device_id = device_id
        cupy.cuda.Device(device_id).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()

    # ------------------------------------------------------------------ kernels
    def load_module(self, sources: list[str]) -> LaunchModule:
        return LaunchModule(load_module(sources, backend="cuda", cupy=self.cupy), self)

    def _on_stream(self) -> None:
        if self.cupy.cuda.get_current_stream() is not self.stream:
            self.stream.use()

    def launch(self, fn, grid, block, args: tuple, shared_mem: int) -> None:
        self._on_stream()
        fn(grid, block, args, shared_mem=shared_mem)

    # ------------------------------------------------------------------ memory and copies
    def upload(self, host: np.ndarray):
        # cupy.asarray stages a host array through pinned memory and copies asynchronously (a
        # copy from pageable memory may wait for the stream's earlier work, which would undo
        # asynchronous scheduling).
        self._on_stream()
        return self.cupy.asarray(host)

    def upload_into(self, dst, host: np.ndarray) -> None:
        self._on_stream()
        dst[...] = self.cupy.asarray(host)  # then one small device-to-device copy

    def to_host(self, x) -> np.ndarray:
        return x.get(stream=self.stream) if isinstance(x, self.cupy.ndarray) else x

    def download_async(self, x) -> "PinnedDownload":
        return PinnedDownload(self.cupyx.empty_pinned(x.shape, dtype=x.dtype), x, self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def memory_info(self) -> tuple[int, int]:
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def reserved_bytes(self) -> int:
        return int(self.cupy.get_default_memory_pool().total_bytes())

    def release_cached(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()

    # ------------------------------------------------------------------ graphs
    def new_pool(self):
        return self.cupy.cuda.MemoryPool()

    @contextmanager
    def use_pool(self, pool):
        with self.cupy.cuda.using_allocator(pool.malloc):
            yield

    def pool_bytes(self, pool) -> int:
        return 0 if pool is None else int(pool.total_bytes())

    def is_capturing(self) -> bool:
        return bool(self.stream.is_capturing())

    def begin_capture(self) -> None:
        self._on_stream()
        self.stream.begin_capture()

    def end_capture(self):
        return self.stream.end_capture()

    def abort_capture(self) -> None:
        try:
            self.stream.end_capture()  # leave the stream usable; the graph is dropped
        except Exception:  # noqa: BLE001 -- an invalidated capture may refuse to end
            pass

    def instantiate(self, graph) -> None:
        graph.upload(self.stream)  # on the device now, not at the first replay

    def replay(self, graph) -> None:
        graph.launch(self.stream)

    def graph_launches(self, graph) -> None:
        return None  # the driver's graph holds them

    def graph_bytes(self, graph, exclude=()) -> int:
        del graph, exclude
        return 0  # the private pool's bytes count every graph's (KernelBackend)

    def graph_output(self, array, pool):
        """A view of a captured output that does not own its memory: the buffer goes back to
        the graph pool, where later captures reuse it (KernelBackend.graph_output)."""
        cupy = self.cupy
        if not array.flags.c_contiguous:
            raise ValueError("graph_output: the graph's output must be C-contiguous")
        memory = cupy.cuda.UnownedMemory(array.data.ptr, array.nbytes, pool)
        return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))

    def host_call(self, fn, args: tuple):
        if self.is_capturing():
            raise GraphCaptureError(f"{getattr(fn, '__name__', fn)}: host work inside a "
                                    "captured region (a GPU graph holds launches only)")
        return fn(*args)

    def array_op(self, fn, args: tuple):
        self._on_stream()
        return fn(*args)  # CuPy's kernels, on the stream: captured with the launches


class PinnedDownload:
    """Device values copied to page-locked host memory right behind the work queued so far (an
    asynchronous copy, then an event on the stream): `read()` waits for that event only, not
    for the work queued after it (the next step's forward, asynchronous scheduling); a plain
    .get() would synchronize the whole stream."""

    def __init__(self, pinned: np.ndarray, device, stream) -> None:
        self._host = pinned
        device.get(out=pinned, stream=stream, blocking=False)
        self._event = stream.record()

    def read(self) -> np.ndarray:
        self._event.synchronize()
        return np.array(self._host)
