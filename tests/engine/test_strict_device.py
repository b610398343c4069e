"""The cuda backend over a strict fake of CuPy 14 (tests/engine/fake_cupy.py): whole engines.

The cuda backend is KernelBackend over CupyRuntime; here the runtime gets the fake in place of
CuPy, so everything the cuda backend runs executes except CuPy itself: device arrays that
refuse to mix with host arrays, kernel launches that refuse host arrays, Python scalars and
None, captures that refuse a synchronize, a host copy, a launch off the captured stream or an
allocation outside the graph pool, and the kernels themselves on the CPU harness. Whole engines
(prefill, decode, preemption, sampling with processors, logprobs, prefix hits, n-gram
speculation, a mixture-of-experts model, decode graphs, asynchronous scheduling) must produce
the sim backend's tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

import fake_cupy
from engine_helpers import ENGINE_BACKENDS, greedy, make_engine, random_weights, run_requests, \
    tiny_config

from pagedrun.runtime.backends.cupy_runtime import CupyRuntime
from pagedrun.runtime.backends.kernel_backend import KernelBackend
from pagedrun.runtime.kernels import kernel_args
from pagedrun.runtime.sampling_params import SamplingParams


def fake_cuda_backend(dtype: str, **kwargs) -> KernelBackend:
    """The cuda backend (cuda_backend.cuda_backend's KernelBackend over CupyRuntime) on a
    fresh fake device."""
    cupy, cupyx = fake_cupy.make()
    return KernelBackend(CupyRuntime(0, cupy=cupy, cupyx=cupyx), dtype, **kwargs)


@pytest.fixture
def strict_engine_factory(monkeypatch):
    def make(model, dtype: str, **config):
        backend = fake_cuda_backend(dtype)
        monkeypatch.setattr("pagedrun.runtime.engine.core.make_backend",
                            lambda *args, **kwargs: backend)
        config.setdefault("enforce_eager", True)
        return make_engine(model, device="sim", dtype=dtype, **config), backend.xp

    return make


def test_array_module_and_launch_check_catch_host_arrays():
    backend = fake_cuda_backend("float32")
    cupy = backend.xp
    device = cupy.zeros(4, np.float32)
    assert kernel_args.array_module(device) is cupy
    with pytest.raises(TypeError, match="device expression"):
        device + np.ones(4, np.float32)
    with pytest.raises(TypeError, match="assigned into a device array"):
        device[...] = np.ones(4, np.float32)
    assert type(device.get()) is np.ndarray and type(device + 1) is fake_cupy.DeviceArray
    fn = backend.module("activation").get_function("silu_and_mul_f32_unaligned")
    x, out = cupy.zeros((1, 8), np.float32), cupy.zeros((1, 4), np.float32)
    fn((1, 1), (128,), (out, x, np.int32(4)))  # device arrays, numpy scalars: fine
    with pytest.raises(TypeError, match="argument 1: a host numpy array"):
        fn((1, 1), (128,), (out, np.zeros((1, 8), np.float32), np.int32(4)))
    with pytest.raises(TypeError, match="argument 2: a Python int"):
        fn((1, 1), (128,), (out, x, 4))
    with pytest.raises(TypeError, match="argument 0: None"):
        fn((1, 1), (128,), (None, x, np.int32(4)))
    odd = cupy.zeros(9, np.float32).view(np.uint8)[1:33].view(np.float32).reshape(1, 8)
    with pytest.raises(fake_cupy.FakeCudaError, match="not aligned"):
        fn((1, 1), (128,), (out, odd, np.int32(4)))


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
    engine, cupy = strict_engine_factory(model, dtype, block_size=16, num_kv_blocks=7,
                                         max_num_batched_tokens=32, **extra)
    got = run_requests(engine, requests)
    assert cupy.launches, "no kernel ran through the fake"
    if extra:
        assert any(name.startswith("rejection") for name in cupy.launches), \
            sorted(set(cupy.launches))
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
    engine, cupy = strict_engine_factory(model, "float32", max_model_len=128)
    got = run_requests(engine, requests)
    assert any(name.startswith("moe") for name in cupy.launches), sorted(set(cupy.launches))
    reference = run_requests(make_engine(model, device="sim", dtype="float32", max_model_len=128),
                             requests)
    for rid, out in got.items():
        assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
