"""Backends: the device seam. Everything above it (engine, scheduler, server) talks to a
`Backend` (runtime/backends/base.py) and never names a device or imports a backend module.

- `base`: the Backend protocol and its declared `BackendCapabilities`; `factory`:
  `make_backend` / `resolve_device` (and the two questions asked of a device before its
  backend exists: `keeps_gguf_blocks`, `uses_gpu`, and `checkpoint_dtype`: what dtype "auto"
  means for a checkpoint), the one place a device string picks a backend.
- `numpy_backend` (+ `numpy_ops`): the cpu backend and the reference every CUDA kernel is
  tested against; `cpu_bf16_backend`: bf16 weights on the compiled cpu GEMM.
- `kernel_backend`: the one backend class of the cuda/*.cu kernels, over a device runtime
  (`device_runtime`): `harness_runtime` (numpy, the CPU harness) or `cupy_runtime` (a GPU);
  `kernel_devices`: its two devices' constructors, `sim_backend` and `cuda_backend`;
  `graph_capture`: their capture sequence;
  `kernel_sampler`: their sampler.
- `step_inputs`: a step's metadata, uploaded once per step.
"""
from .base import Backend, BackendCapabilities
from .factory import (checkpoint_dtype, keeps_gguf_blocks, make_backend, resolve_device,
                      resolve_dtype, uses_gpu)

__all__ = ["Backend", "BackendCapabilities", "checkpoint_dtype", "keeps_gguf_blocks",
           "make_backend", "resolve_device", "resolve_dtype", "uses_gpu"]
