"""The one place a device string becomes a Backend: `make_backend` (and the device / dtype
resolution it applies). Concrete backend modules are imported here, lazily, and nowhere above
the seam; importing this module never imports cupy.
"""
from __future__ import annotations

import logging

from pagedrun.runtime.engine_config import (
    DEVICES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfigError)
from pagedrun.runtime import cpu_isa as cpu_isa_module
from pagedrun.runtime.errors import DeviceNotAvailableError

from .base import AUTO_DTYPE, DTYPE_NAMES, Backend

log = logging.getLogger("pagedrun.backends")


def resolve_dtype(device: str, dtype: str) -> str:
    if dtype == "auto":
        return AUTO_DTYPE[device]
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPE_NAMES}, got {dtype!r}")
    return dtype


def resolve_device(device: str) -> str:
    """"auto": cuda when CuPy sees a GPU, else cpu. "sim" runs the CUDA kernels on the CPU
    harness; "cuda" without a usable GPU raises DeviceNotAvailableError."""
    if device in ("cpu", "sim"):
        return device
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    from .cuda_probe import cuda_available

    if cuda_available():
        return "cuda"
    if device == "auto":
        return "cpu"
    raise DeviceNotAvailableError(
        f"device {device!r}: CuPy is not installed or sees no GPU; use device='cpu' (numpy) "
        "or 'sim' (the CUDA kernels on the CPU harness)")


# A checkpoint's torch_dtype -> what dtype "auto" serves it in on the cpu device: its own
# precision where a cpu backend computes in it (bf16 weights on the compiled bf16 GEMMs, half
# float32's bytes); float16 has no cpu backend (float32 holds it exactly), float32 is float32.
CPU_CHECKPOINT_DTYPES = {"bfloat16": "bfloat16"}


def checkpoint_dtype(device: str, dtype: str, torch_dtype: str | None) -> str:
    """EngineConfig.dtype with "auto" settled by the checkpoint where the device serves its
    precision (cpu: a bfloat16 checkpoint runs on the bf16 backend); anything else as given
    (then resolve_dtype's device default applies)."""
    if dtype != "auto" or torch_dtype is None or resolve_device(device) != "cpu":
        return dtype
    return CPU_CHECKPOINT_DTYPES.get(torch_dtype, dtype)


def keeps_gguf_blocks(device: str) -> bool:
    """Whether the device's backend computes on a GGUF file's own blocks (the cpu backends'
    GGUF GEMMs), so a .gguf model under dtype "auto" is served as stored
    (model_loader.resolve_quantization)."""
    return resolve_device(device) == "cpu"


def uses_gpu(device: str) -> bool:
    """Whether each rank of the device holds one GPU (Ray places a GPU per rank)."""
    return resolve_device(device) == "cuda"


def _check_kv_cache_dtype(kv_cache_dtype: str, kv_dtype: str, backend: str) -> None:
    """Refuse a kv_cache_dtype other than "auto" or the one a backend holds (kv_dtype)."""
    if kv_cache_dtype not in ("auto", kv_dtype):
        raise EngineConfigError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not served by {backend}, whose KV cache is "
            f"{kv_dtype} (use 'auto'; a bfloat16 cache on cpu needs --dtype bfloat16 or "
            "--quantization int8)")


# kv_cache_dtype values of an fp8 e4m3 cache (vLLM's name and its explicit alias).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def make_backend(device: str, dtype: str = "auto", *, device_id: int = 0,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 cpu_isa: str = "auto") -> Backend:
    """The backend of a device ("auto" is resolved first); device_id: the GPU of a cuda rank;
    quantization: EngineConfig.quantization (None or "none": the dtype's weights);
    kv_cache_dtype: EngineConfig.kv_cache_dtype -- "auto": bfloat16 on the cpu bf16 / int8
    backends, float32 on the float32 cpu backend, the activation dtype on sim / cuda; "fp8" /
    "fp8_e4m3" (uint8 e4m3 bits, scale 1.0) on every backend; a combination a backend cannot
    hold raises EngineConfigError. cpu_isa: EngineConfig.cpu_isa, the compiled cpu kernels'
    instruction-set cap (runtime/cpu_isa.py), applied and logged for a cpu backend."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineConfigError(
            f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    device = resolve_device(device)
    backend = _make(device, dtype, device_id, quantization, kv_cache_dtype, cpu_isa)
    if device == "cpu" and backend.dtype_name != "float32":  # the compiled kernels serve it
        log.info("%s", cpu_isa_module.describe(cpu_isa))
    # (the float32 cpu backend is numpy's: no compiled kernel to cap)
    return backend


def _make(device: str, dtype: str, device_id: int, quantization: str | None,
          kv_cache_dtype: str, cpu_isa: str) -> Backend:
    if device == "cpu":
        cpu_isa_module.apply(cpu_isa)
    if quantization not in (None, "none"):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if device != "cpu":
            # cuda/gemm_wq.cu: W4A16 for awq / gptq checkpoints, W8A16 for int8 made at load;
            # 16-bit activations (float32 refused by the backend).
            if quantization not in ("awq", "gptq", "int8"):
                raise ValueError(f"quantization {quantization!r} runs on the cpu backend; "
                                 f"device {device!r} has no {quantization} GEMM yet")
            # "auto": float16 for the int4 checkpoints, whose fp16 scales are exact in it;
            # bfloat16 for int8.
            if dtype == "auto":
                resolved = "bfloat16" if quantization == "int8" else "float16"
            else:
                resolved = resolve_dtype(device, dtype)
            if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:  # as the float sim / cuda below
                _check_kv_cache_dtype(kv_cache_dtype, resolved,
                                      f"the {device} backend with dtype {resolved}")
                kv_cache_dtype = "auto"
            if device == "sim":
                from .kernel_devices import sim_backend

                return sim_backend(resolved, kv_cache_dtype=kv_cache_dtype,
                                   quantization=quantization)
            from .kernel_devices import cuda_backend

            return cuda_backend(resolved, device_id=device_id, kv_cache_dtype=kv_cache_dtype,
                                quantization=quantization)
        resolved = resolve_dtype(device, dtype)
        if quantization in ("gguf", "awq", "gptq"):  # int4 AWQ / GPTQ: the gguf kernels' I4Z
            from .cpu_gguf_backend import CpuGgufBackend

            if resolved != "bfloat16":
                log.info("quantization %s: int8-quantized activations in the GEMMs, the rest "
                         "of the step as the bf16 backend (dtype %s is not used)", quantization,
                         resolved)
            return CpuGgufBackend(kv_cache_dtype=kv_cache_dtype, quantization=quantization)
        if resolved != "bfloat16":
            log.info("quantization int8: the GEMMs take int8-quantized activations "
                     "(dtype %s applies to the rest of the step)", resolved)
        from .cpu_int8_backend import CpuInt8Backend

        return CpuInt8Backend(kv_cache_dtype=kv_cache_dtype)
    if device == "cpu":
        resolved = resolve_dtype(device, dtype)
        if resolved == "bfloat16":  # bf16 weights on the compiled GEMM
            from .cpu_bf16_backend import CpuBf16Backend

            return CpuBf16Backend(kv_cache_dtype=kv_cache_dtype)
        if resolved == "float16":
            # numpy's float16 GEMMs are slow: the cpu backend computes float16 in float32.
            log.warning("dtype float16: the cpu backend runs float32")
        from .numpy_backend import NumpyBackend

        if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            return NumpyBackend(kv_cache_dtype=kv_cache_dtype)
        _check_kv_cache_dtype(kv_cache_dtype, "float32", "the float32 cpu backend")
        return NumpyBackend()
    # sim / cuda: the KV cache is in the activation dtype, or fp8 e4m3 codes (the kernels'
    # _kv_fp8 instantiations).
    resolved = resolve_dtype(device, dtype)
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        _check_kv_cache_dtype(kv_cache_dtype, resolved,
                              f"the {device} backend with dtype {resolved}")
        kv_cache_dtype = "auto"
    if device == "sim":
        from .kernel_devices import sim_backend

        return sim_backend(resolved, kv_cache_dtype=kv_cache_dtype)
    from .kernel_devices import cuda_backend

    return cuda_backend(resolved, device_id=device_id, kv_cache_dtype=kv_cache_dtype)
