"""NcclCommunicator: the GPU collectives, NCCL through `cupy.cuda.nccl` (we write none).

Rank 0 creates the unique id (`make_unique_id`, 128 bytes) and the driver hands it to every rank
in the plan over our ZeroMQ control plane (executor.py); every rank then calls
`ncclCommInitRank` with it, which blocks until all ranks have joined. Collectives are enqueued
on the backend's compute stream (`use_stream`; build_rank passes it), so they order with the
kernels around them without a host synchronization.

`send(x, peer)` / `recv(shape, dtype, peer)`: point to point, for the activations between
pipeline stages (pipeline.py: a two-rank communicator per link).

`all_reduce(x)`: in-place sum of a contiguous cupy array (float32, float16, or bf16 stored as
uint16 bits). `gather(x)`: NCCL has no gather; rank 0 needs every rank's logits slice, so it is
an allGather into a [world, *x.shape] buffer (logits are small next to the weights; the other
ranks drop their copy).

The import of cupy is guarded: without CuPy (the CPU machines) this module imports, and
constructing a communicator raises NcclNotAvailableError saying what to install.
"""
from __future__ import annotations

import numpy as np

from pagedrun.runtime.errors import PagedRunError

try:  # guarded: CPU-only machines have no CuPy
    import cupy
    from cupy.cuda import nccl
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None
    nccl = None


class NcclNotAvailableError(PagedRunError):
    """CuPy or its NCCL binding is missing."""


def _require_nccl() -> None:
    if nccl is None or not getattr(nccl, "available", True):
        raise NcclNotAvailableError(
            "tensor parallelism on cuda needs CuPy with NCCL (pip install cupy-cuda12x; "
            "python -m cupyx.tools.install_library --library nccl --cuda 12.x)")


def _nccl_dtype(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return nccl.NCCL_FLOAT32
    if dtype == np.float16:
        return nccl.NCCL_FLOAT16
    if dtype == np.uint16:  # bf16 bits
        bf16 = getattr(nccl, "NCCL_BFLOAT16", None)
        if bf16 is None:
            raise NcclNotAvailableError("this CuPy's NCCL binding has no NCCL_BFLOAT16")
        return bf16
    raise TypeError(f"all_reduce: unsupported dtype {dtype}")


class NcclCommunicator:
    device_arrays = True  # collectives take cupy arrays on this rank's device

    def __init__(self, rank: int, world_size: int, unique_id: bytes | tuple, *,
                 device_id: int = 0) -> None:
        _require_nccl()
        self.rank, self.world_size = rank, world_size
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.comm = nccl.NcclCommunicator(world_size, tuple(unique_id), rank)
        self.stream = None  # the backend's compute stream, once `use_stream` names it

    def use_stream(self, stream) -> None:
        """Enqueue collectives on `stream` (the cuda backend's): the engine steps in another
        thread than the one that built the backend, and cupy's current stream is per thread."""
        self.stream = stream

    def _stream_ptr(self) -> int:
        return (self.stream or cupy.cuda.get_current_stream()).ptr

    @staticmethod
    def make_unique_id() -> list[int]:
        """Rank 0's NCCL unique id, as a msgpack-able list of ints."""
        _require_nccl()
        return list(nccl.get_unique_id())

    def all_reduce(self, x):
        x = cupy.ascontiguousarray(x)
        stream = self._stream_ptr()
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, _nccl_dtype(x.dtype), nccl.NCCL_SUM,
                            stream)
        return x

    def gather(self, x):
        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self.world_size, *x.shape), dtype=x.dtype)
        stream = self._stream_ptr()
        # allGather counts elements per rank; uint16 (bf16 bits) travels as raw 16-bit words.
        dtype = nccl.NCCL_FLOAT16 if x.dtype == np.uint16 else _nccl_dtype(x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, dtype, stream)
        if self.rank != 0:
            return None
        return [out[r] for r in range(self.world_size)]

    def send(self, x, peer: int) -> None:
        """Point-to-point: x (a contiguous cupy array) to rank `peer`, on the stream; its bytes
        as they are (any dtype). The peer must post the matching `recv`."""
        x = cupy.ascontiguousarray(x)
        self.comm.send(x.data.ptr, x.nbytes, nccl.NCCL_INT8, peer, self._stream_ptr())

    def recv(self, shape, dtype, peer: int):
        """Point-to-point: a new cupy array of shape/dtype filled from rank `peer`'s `send`
        (enqueued on the stream: later kernels on it see the data)."""
        out = cupy.empty(tuple(shape), dtype=dtype)
        self.comm.recv(out.data.ptr, out.nbytes, nccl.NCCL_INT8, peer, self._stream_ptr())
        return out

    def abort(self) -> None:
        """ncclCommAbort, from the executor's watchdog thread: a collective blocked on a lost
        rank returns with an error instead of hanging."""
        comm = self.comm
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()
