"""The cuda backend's argument marshalling against a strict device stand-in (issue 14, item 4).

On a GPU a host numpy array handed to a CuPy kernel launch is refused (or, for a scalar path,
silently read as garbage), and a numpy array mixed into a CuPy expression raises. The sim
backend cannot see that class of bug: there every "device" array is numpy. Here the kernel
backend (the code the cuda backend runs) gets a stand-in array module: device arrays are
`DeviceArray` (a numpy subclass that, like CuPy, refuses to mix with host arrays in arithmetic
and comes back to the host only through `.get()`), and every kernel launch goes through
`StrictFunction`, which refuses any plain numpy array argument before the CPU harness runs the
kernel. Whole engines (prefill, decode, preemption, sampling with processors, logprobs, prefix
hits, n-gram speculation, a mixture-of-experts model) run under it and must produce the sim
backend's tokens.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine_helpers import ENGINE_BACKENDS, greedy, make_engine, random_weights, run_requests, \
    tiny_config

from pagedrun.runtime.backends.sim_backend import KernelBackend
from pagedrun.runtime.kernels import kernel_args
from pagedrun.runtime.sampling_params import SamplingParams


class HostArrayToKernel(AssertionError):
    """A host numpy array reached a kernel launch or a device expression."""


class DeviceArray(np.ndarray):
    """A numpy array standing in for a CuPy device array."""

    pagedrun_array_module = None  # STRICT_XP, set below (kernel_args.array_module reads it)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for value in inputs + tuple(kwargs.get("out", ())):
            if type(value) is np.ndarray and value.ndim > 0:
                raise HostArrayToKernel(f"{ufunc.__name__}: a host numpy array {value.shape} "
                                        "mixed into a device expression (CuPy refuses it)")
        plain = [np.asarray(v) if isinstance(v, DeviceArray) else v for v in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(v) for v in kwargs["out"])
        result = getattr(ufunc, method)(*plain, **kwargs)
        if isinstance(result, np.ndarray):
            return result.view(DeviceArray)
        if isinstance(result, tuple):
            return tuple(r.view(DeviceArray) if isinstance(r, np.ndarray) else r for r in result)
        return result

    def get(self) -> np.ndarray:
        """device -> host: a plain numpy copy (CuPy's ndarray.get)."""
        return np.array(self)

    @property
    def data(self):
        """CuPy's memory pointer (`.ptr`, and `memptr=` for `xp.ndarray`)."""
        return SimpleNamespace(ptr=self.ctypes.data, array=self)


def _device(value):
    return value.view(DeviceArray) if isinstance(value, np.ndarray) else value


class StrictXp:
    """The array module of the stand-in: numpy whose allocations and uploads are DeviceArrays."""

    ndarray_type = DeviceArray
    cuda = SimpleNamespace(Device=lambda: SimpleNamespace(id=0))
    _MAKERS = ("empty", "zeros", "empty_like", "zeros_like", "asarray", "ascontiguousarray",
               "array", "stack", "arange", "concatenate", "full")

    def __getattr__(self, name):
        attr = getattr(np, name)
        if name not in self._MAKERS:
            return attr

        def make(*args, **kwargs):
            args = [np.asarray(a) if isinstance(a, DeviceArray) else a for a in args]
            return _device(attr(*args, **kwargs))

        return make

    @staticmethod
    def ndarray(shape, dtype, memptr):
        """CuPy's ndarray over existing memory: a flat run starting at memptr's array."""
        base = memptr.array
        return np.lib.stride_tricks.as_strided(base, shape=shape,
                                               strides=(np.dtype(dtype).itemsize,)).view(
            DeviceArray)


STRICT_XP = StrictXp()
DeviceArray.pagedrun_array_module = STRICT_XP


class StrictFunction:
    """A harness kernel that refuses host arrays among its launch arguments."""

    def __init__(self, function, launches: list) -> None:
        object.__setattr__(self, "_function", function)
        object.__setattr__(self, "launches", launches)  # every launch's kernel name

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        args = tuple(args)
        checked = []
        for index, (code, value) in enumerate(zip(self._function.param_codes, args)):
            if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray):
                raise HostArrayToKernel(f"kernel {self._function.name} argument {index}: a host "
                                        f"numpy array {value.shape} {value.dtype} (upload it)")
            if code == "p" and isinstance(value, np.uint64) and value == 0:
                value = None  # CuPy's explicit NULL (gemm._nullable) is the harness's None
            checked.append(value)
        self.launches.append(self._function.name)
        return self._function(grid, block, checked, shared_mem=shared_mem, stream=stream)

    def __getattr__(self, name):
        return getattr(self._function, name)

    def __setattr__(self, name, value):
        setattr(self._function, name, value)


class StrictModule:
    def __init__(self, module, launches: list) -> None:
        self._module = module
        self._launches = launches

    def get_function(self, name: str) -> StrictFunction:
        return StrictFunction(self._module.get_function(name), self._launches)

    def __getattr__(self, name):
        return getattr(self._module, name)


class StrictDeviceBackend(KernelBackend):
    """KernelBackend (the cuda backend's code) over the strict stand-in."""

    name = "sim"  # the sim backend's kernel shapes and budgets

    def __init__(self, dtype_name: str) -> None:
        super().__init__(dtype_name, STRICT_XP)
        self.launches: list[str] = []

    def module(self, group: str):
        return StrictModule(super().module(group), self.launches)

    def to_host(self, x) -> np.ndarray:
        return super().to_host(x.get() if isinstance(x, DeviceArray) else x)


@pytest.fixture
def strict_engine_factory(monkeypatch):
    monkeypatch.setattr(kernel_args, "_cuda_num_sms", lambda device_id: kernel_args.SIM_NUM_SMS)

    def make(model, dtype: str, **config):
        backend = StrictDeviceBackend(dtype)
        monkeypatch.setattr("pagedrun.runtime.engine.make_backend",
                            lambda *args, **kwargs: backend)
        return make_engine(model, device="sim", dtype=dtype, **config), backend

    return make


def test_array_module_and_launch_check_catch_host_arrays():
    device = STRICT_XP.zeros(4, np.float32)
    assert kernel_args.array_module(device) is STRICT_XP
    with pytest.raises(HostArrayToKernel, match="device expression"):
        device + np.ones(4, np.float32)
    assert type(device.get()) is np.ndarray and type(device + 1) is DeviceArray

    class Recorder:
        name, param_codes = "k", ("p", "p")

        def __call__(self, *args, **kwargs):
            return None

    function = StrictFunction(Recorder(), [])
    function((1,), (1,), (device, np.uint64(0)))  # a device array and CuPy's NULL: fine
    with pytest.raises(HostArrayToKernel, match="kernel k argument 1"):
        function((1,), (1,), (device, np.zeros(4, np.float32)))


@pytest.mark.parametrize("dtype,extra", [
    ("float32", {}), ("bfloat16", {}),
    # n-gram speculation: verification rows through the prefill kernel, the rejection kernel.
    ("float32", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1}})],
    ids=["float32", "bfloat16", "float32-ngram"])
def test_engine_under_strict_device_matches_sim(strict_engine_factory, dtype, extra):
    spec = ENGINE_BACKENDS["sim"]
    config = tiny_config(**spec.model_overrides)
    model = (config, random_weights(config))
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, config.vocab_size, 19).tolist()
    prompts = [prefix + rng.integers(3, config.vocab_size, n).tolist() for n in (1, 17, 40, 5)]
    requests = [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=params))
                for i, (p, params) in enumerate(zip(prompts, [
                    greedy(6), greedy(5, logprobs=2),
                    SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=3,
                                   repetition_penalty=1.2, logit_bias={7: 2.0}),
                    greedy(4, prompt_logprobs=1)]))]
    # Few blocks: the later requests preempt or wait; the shared prefix hits the cache.
    engine, backend = strict_engine_factory(model, dtype, block_size=16, num_kv_blocks=7,
                                            max_num_batched_tokens=32, **extra)
    got = run_requests(engine, requests)
    assert backend.launches, "no kernel ran through the strict module"
    if extra:
        assert any(name.startswith("rejection") for name in backend.launches), \
            sorted(set(backend.launches))
    reference = run_requests(make_engine(model, device="sim", dtype=dtype, block_size=16,
                                         num_kv_blocks=7, max_num_batched_tokens=32, **extra),
                             requests)
    for rid, out in got.items():
        assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
        assert out.outputs[0].finish_reason == reference[rid].outputs[0].finish_reason


def test_moe_engine_under_strict_device_matches_sim(strict_engine_factory):
    # Routing, the expert permutation and the grouped GEMMs (moe.cu) under the strict module.
    from pathlib import Path

    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.weights import load_model_weights

    model_dir = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "mixtral_moe"
    config = ModelConfig.from_model_dir(model_dir)
    model = (config, load_model_weights(model_dir, config))
    rng = np.random.default_rng(11)
    requests = [(i, f"r{i}", dict(prompt_token_ids=rng.integers(3, config.vocab_size, n).tolist(),
                                  sampling_params=greedy(5)))
                for i, n in enumerate((1, 9, 21))]
    engine, backend = strict_engine_factory(model, "float32", max_model_len=128)
    got = run_requests(engine, requests)
    assert any(name.startswith("moe") for name in backend.launches), sorted(set(backend.launches))
    reference = run_requests(make_engine(model, device="sim", dtype="float32", max_model_len=128),
                             requests)
    for rid, out in got.items():
        assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
