"""The device runtime: what the kernel backend needs of a device, and nothing else.

    runtime = HarnessRuntime()          # runtime/backends/harness_runtime.py: numpy + CPU threads
    runtime = CupyRuntime(device_id)    # runtime/backends/cupy_runtime.py: CuPy on a GPU
    backend = KernelBackend(runtime, "bfloat16")   # runtime/backends/kernel_backend.py

KernelBackend -- the model's ops, weight placement, graph capture and replay, the KV budget
around profile_run, the kernel sampler -- is one class over this interface, so every line of
it runs in CI on the harness runtime. A runtime owns only the primitives below; the CuPy one
is the only code CI cannot execute (tests/engine/test_cupy_runtime.py drives it against a
strict fake of CuPy 14).

Primitives (a runtime implements all of them; shapes and dtypes are the caller's):
  name, communicator       "sim" | "cuda"; "cpu" (host collectives) | "nccl"
  xp                       the array module of device arrays (numpy | cupy); while the harness
                           captures, its recording stand-in
  stream                   the compute stream every launch goes to (None on the harness)
  graphs_by_default        whether decode graphs are captured when the config names no sizes
  load_module(sources)     the kernel module of cuda/<sources> (get_function(name) -> function)
  launch(fn, grid, block, args, shared_mem)
                           one kernel launch on the compute stream (recorded while capturing)
  upload(host) / upload_into(dst, host) / to_host(x) / download_async(x)
                           host <-> device copies; to_host synchronizes, download_async
                           returns a PendingHost whose read() waits for that copy only
  synchronize()            wait for the compute stream
  new_pool() / use_pool(pool) / pool_bytes(pool)
                           a private memory pool and the context that allocates from it
  begin_capture() / end_capture() -> graph / abort_capture()
  instantiate(graph) / replay(graph) / graph_launches(graph) / graph_bytes(graph, exclude)
  graph_output(array, pool)  a captured output as replays fill it
  host_call(fn, args)      a host step between launches (refused while a GPU captures)
  array_op(fn, args)       array-module work between launches, captured with them
  memory_info()            (free, total) device bytes, or None where the runtime has no
                           device memory to measure (the harness: a fixed host budget)
  reserved_bytes() / release_cached()
                           bytes the default pool holds; hand its free blocks back
"""
from __future__ import annotations

from typing import Protocol


class LaunchFunction:
    """A kernel function whose calls launch through its runtime (`runtime.launch`), so a
    capture sees every launch; attribute reads and writes go to the function itself."""

    __slots__ = ("_fn", "_runtime")

    def __init__(self, fn, runtime) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_runtime", runtime)

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        del stream  # the runtime's compute stream, always
        self._runtime.launch(self._fn, grid, block, tuple(args), shared_mem)

    def __getattr__(self, name: str):
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._fn, name, value)


class LaunchModule:
    """A loaded module whose functions launch through `runtime` (LaunchFunction); fetched
    functions are kept, as CuPy keeps a module's kernels."""

    def __init__(self, module, runtime) -> None:
        self.raw = module
        self._runtime = runtime
        self._functions: dict[str, LaunchFunction] = {}

    def get_function(self, name: str) -> LaunchFunction:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = LaunchFunction(self.raw.get_function(name),
                                                        self._runtime)
        return fn

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


class PendingHost(Protocol):
    def read(self): ...  # the host numpy copy, once the device-to-host copy has landed


class HostReady:
    """download_async of an array that is already host memory (the harness; a sampler built
    without a runtime): read() is the array itself."""

    __slots__ = ("_x",)

    def __init__(self, x) -> None:
        self._x = x

    def read(self):
        return self._x


class DeviceRuntime(Protocol):
    name: str
    communicator: str
    xp: object
    stream: object
    graphs_by_default: bool

    def load_module(self, sources: list[str]): ...
    def launch(self, fn, grid, block, args: tuple, shared_mem: int) -> None: ...
    def upload(self, host): ...
    def upload_into(self, dst, host) -> None: ...
    def to_host(self, x): ...
    def download_async(self, x) -> PendingHost: ...
    def synchronize(self) -> None: ...
    def new_pool(self): ...
    def use_pool(self, pool): ...
    def pool_bytes(self, pool) -> int: ...
    def begin_capture(self) -> None: ...
    def end_capture(self): ...
    def abort_capture(self) -> None: ...
    def is_capturing(self) -> bool: ...
    def instantiate(self, graph) -> None: ...
    def replay(self, graph) -> None: ...
    def graph_launches(self, graph) -> int | None: ...
    def graph_bytes(self, graph, exclude) -> int: ...
    def graph_output(self, array, pool): ...
    def host_call(self, fn, args: tuple): ...
    def array_op(self, fn, args: tuple): ...
    def memory_info(self) -> tuple[int, int] | None: ...
    def reserved_bytes(self) -> int: ...
    def release_cached(self) -> None: ...
