"""Backends: the device seam. Everything above it (engine, scheduler, server) talks to a
`Backend` (runtime/backends/base.py) and never names a device or imports a backend module.

- `base`: the Backend protocol; `factory`: `make_backend` / `resolve_device`, the one place a
  device string picks a backend.
- `numpy_backend` (+ `numpy_ops`): the cpu backend and the reference every CUDA kernel is
  tested against; `cpu_bf16_backend`: bf16 weights on the compiled cpu GEMM.
- `sim_backend` / `cuda_backend`: the cuda/*.cu kernels on numpy arrays under the CPU harness,
  or on cupy arrays through RawModule; `kernel_sampler`: their sampler.
- `step_inputs`: a step's metadata, uploaded once per step.
"""
from .base import Backend
from .factory import make_backend, resolve_device, resolve_dtype

__all__ = ["Backend", "make_backend", "resolve_device", "resolve_dtype"]
