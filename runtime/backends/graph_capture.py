"""Graph capture for the kernel backend: a region of launches recorded once, replayed as one.

    with backend.graph_capture() as captured:       # KernelBackend.graph_capture
        logits = model.logits(*model.forward(...))  # launches on static input buffers
    captured.replay()                               # the same launches, the same buffers

The sequence is the same on every device runtime (runtime/backends/device_runtime.py), and this
module is the one place it is written, so CI runs it on the harness: wait for the stream
(nothing eager may be in flight into the capture), allocate from the backend's private graph
pool (created on the first capture, shared by all of its graphs, never handed back: a replay
writes the addresses the capture saw, which must belong to nothing else), begin, run the body,
end (or abort, leaving the stream usable), instantiate on the device now rather than at the
first replay. Graphs replay one at a time on the one stream, so they share the pool's buffers,
outputs included (KernelBackend.graph_output: each output is consumed before the next replay).

On cuda the runtime is CuPy's stream capture (relaxed mode, so the pool may grow while
capturing) into a cupy.cuda.Graph; on the harness, the recorded launch list of
runtime/backends/harness_runtime.py.
"""
from __future__ import annotations

from contextlib import contextmanager


class GraphCaptureError(RuntimeError):
    """A region could not be captured (the message says what in it cannot be)."""


class CapturedGraph:
    """One captured region: `replay()` re-runs it; `num_launches` (the harness: the kernels
    recorded; cuda: None, the driver's graph holds them) and `graph` for the memory log."""

    def __init__(self, runtime) -> None:
        self._runtime = runtime
        self.num_launches: int | None = None
        self.graph = None  # the runtime's graph (SimGraph or cupy.cuda.Graph)

    def replay(self) -> None:
        if self.graph is None:
            raise GraphCaptureError("the graph is replayed before its capture ended")
        self._runtime.replay(self.graph)


@contextmanager
def capture_graph(backend):
    """Capture the body's launches on `backend.runtime` into the CapturedGraph it yields."""
    runtime = backend.runtime
    if runtime.is_capturing():
        raise GraphCaptureError("a capture is already in progress on this backend")
    if backend.graph_pool is None:
        backend.graph_pool = runtime.new_pool()
    runtime.synchronize()
    captured = CapturedGraph(runtime)
    with runtime.use_pool(backend.graph_pool):
        runtime.begin_capture()
        try:
            yield captured
        except BaseException:
            runtime.abort_capture()
            raise
        graph = runtime.end_capture()
    runtime.instantiate(graph)
    captured.graph = graph
    captured.num_launches = runtime.graph_launches(graph)
