"""The sim backend end to end: the tiny random Llama (head_dim 64, GQA) through every CUDA kernel
on the CPU harness -- GEMMs, norms, SiLU, embedding, rotary + cache write, paged decode and
prefill attention, block copies.

- fp32 weights: LLM(device="sim") gives the numpy backend's greedy tokens exactly (the engine's
  mixes, chunked prefill, prefix hits and preemption on sim: test_engine_greedy.py's sim cases).
- bf16 weights: the model's logits are within the bf16 tolerance of the numpy model run on the
  same bf16-rounded weights, prefill and decode.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (
    greedy,
    make_engine,
    random_weights,
    run_requests,
    tiny_config,
)
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.backends.numpy_ops import round_to_bf16
from pagedrun.runtime.engine import DeviceNotAvailableError
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape
from pagedrun.runtime.model_runner import build_attention_inputs
from pagedrun.runtime.models.llama import LlamaModel
from pagedrun.runtime.weights import LayerWeights, ModelWeights

# Logits of a bf16 model vs the fp32 model on the same (rounded) weights: activations are
# rounded to bf16 (2^-9 relative) at every op boundary of 2 layers; logits here have a spread of
# about +-10, so 0.15 absolute is ~1.5% of the range -- and a wrong kernel is off by O(1).
BF16_LOGIT_ATOL = 0.15
BF16_LOGIT_RTOL = 0.03


@pytest.fixture(scope="module")
def sim_model():
    """Tiny Llama whose attention the kernels serve: head_dim 64, 2 query heads per kv head."""
    config = tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=160)
    return config, random_weights(config, seed=5)


def test_sim_engine_reports_its_device_and_dtype(sim_model):
    """Its greedy tokens under chunked prefill, prefix hits and preemption by recompute and by
    swap (block_copy.cu) are test_engine_greedy.py's sim cases, against the dense reference."""
    engine = make_engine(sim_model, device="sim", num_kv_blocks=48, block_size=16)
    assert engine.model_info()["device"] == "sim"
    assert engine.model_info()["dtype"] == "float32"


def test_llm_device_sim_matches_cpu(sim_model, tmp_path):
    from pagedrun import LLM
    from test_engine_admission import _save_hf_dir

    _save_hf_dir(tmp_path, *sim_model)
    prompts = [[5, 6, 7], list(range(10, 60))]
    outs = {}
    for device in ("cpu", "sim"):
        llm = LLM(model=str(tmp_path), device=device, block_size=16, max_model_len=128,
                  num_kv_blocks=16, max_num_batched_tokens=32)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5))]
    assert outs["sim"] == outs["cpu"]


def _bf16_weights(weights: ModelWeights) -> ModelWeights:
    r = round_to_bf16
    layers = [LayerWeights(**{k: (None if v is None else r(v)) for k, v in vars(lw).items()})
              for lw in weights.layers]
    return ModelWeights(config=weights.config, embed_tokens=r(weights.embed_tokens),
                        layers=layers, norm=r(weights.norm), lm_head=r(weights.lm_head))


def _run_two_steps(model: LlamaModel, backend, config, prompt_len: int, num_blocks: int = 8):
    """A prefill of prompt_len tokens, then one decode step; returns both steps' last logits."""
    block_shape = (16, config.num_key_value_heads, config.head_dim)
    k_caches = [backend.zeros((num_blocks, *block_shape), backend.kv_dtype)
                for _ in range(config.num_hidden_layers)]
    v_caches = [backend.zeros((num_blocks, *block_shape), backend.kv_dtype)
                for _ in range(config.num_hidden_layers)]
    block_table = np.array([[5, 2, 7, 0]], dtype=np.int32)  # shuffled physical blocks
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, config.vocab_size, prompt_len + 1).astype(np.int32)
    logits = []
    for start, stop in ((0, prompt_len), (prompt_len, prompt_len + 1)):
        positions = np.arange(start, stop, dtype=np.int32)
        slots = (block_table[0, positions // 16] * 16 + positions % 16).astype(np.int32)
        qsl = np.array([0, stop - start], dtype=np.int32)
        attn = build_attention_inputs(qsl, np.diff(qsl).astype(np.int32),
                                      np.array([stop], np.int32), block_table)
        x, residual = model.forward(tokens[start:stop], positions, slots, attn, k_caches, v_caches)
        logits.append(backend.to_host(model.logits(x[-1:], residual[-1:]))[0])
    return np.stack(logits)


def test_bf16_sim_logits_within_tolerance_of_numpy(sim_model):
    config, weights = sim_model
    bf16_weights = _bf16_weights(weights)
    sim = make_backend("sim", "bfloat16")
    assert sim.kv_dtype == np.uint16 and sim.dtype_name == "bfloat16"
    got = _run_two_steps(LlamaModel(config, bf16_weights, sim, max_position=256), sim, config, 37)
    ref_backend = NumpyBackend()
    expected = _run_two_steps(LlamaModel(config, bf16_weights, ref_backend, max_position=256),
                              ref_backend, config, 37)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    err = np.abs(got - expected)
    assert np.all(err <= BF16_LOGIT_ATOL + BF16_LOGIT_RTOL * np.abs(expected)), err.max()
    # Far from ties, bf16 picks numpy's greedy token.
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 4 * BF16_LOGIT_ATOL
    np.testing.assert_array_equal(got.argmax(1)[clear], expected.argmax(1)[clear])


def test_fp16_sim_logits_close_to_numpy_fp32(sim_model):
    """float16 kernels (10 mantissa bits) on the fp32 weights: within a quarter of the bf16
    budget."""
    config, weights = sim_model
    sim = make_backend("sim", "float16")
    got = _run_two_steps(LlamaModel(config, weights, sim, max_position=256), sim, config, 21)
    ref = NumpyBackend()
    expected = _run_two_steps(LlamaModel(config, weights, ref, max_position=256), ref, config, 21)
    err = np.abs(got - expected)
    assert np.all(err <= (BF16_LOGIT_ATOL + BF16_LOGIT_RTOL * np.abs(expected)) / 4), err.max()


def test_devices_refuse_what_they_cannot_run(tiny_cpu_model, sim_model):
    with pytest.raises(UnsupportedKernelShape, match="head_dim 16"):
        make_engine(tiny_cpu_model, device="sim", num_kv_blocks=8)  # tiny_cpu_model: head_dim 16
    with pytest.raises(UnsupportedKernelShape, match="block_size 8"):
        make_engine(sim_model, device="sim", num_kv_blocks=8, block_size=8)
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(DeviceNotAvailableError, match="sim"):
            make_engine(sim_model, device="cuda", num_kv_blocks=8)


def test_sim_sampling_kernels_draw_the_cpu_tokens(sim_model):
    """The engine on sim samples with cuda/sampling.cu: seeded and unseeded requests, penalties,
    top-k/top-p/min-p, n > 1 and logprobs give the numpy sampler's tokens (same uniforms)."""
    from pagedrun.runtime.sampling_params import SamplingParams

    params = [SamplingParams(seed=1, top_k=20, max_tokens=5),
              SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, max_tokens=5),
              SamplingParams(seed=2, min_p=0.05, frequency_penalty=0.3, logprobs=2, max_tokens=5),
              SamplingParams(n=2, seed=3, temperature=1.1, presence_penalty=0.5, max_tokens=4)]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, sim_model[0].vocab_size, n).tolist() for n in (9, 30, 17, 5)]
    results = {}
    for device in ("cpu", "sim"):
        engine = make_engine(sim_model, device=device, num_kv_blocks=48, seed=9)
        outs = run_requests(engine, [(0, f"r{i}", dict(prompt_token_ids=p, sampling_params=sp))
                                     for i, (p, sp) in enumerate(zip(prompts, params))])
        results[device] = {k: [(c.token_ids, c.logprobs) for c in v.outputs]
                           for k, v in outs.items()}
    assert type(make_engine(sim_model, device="sim", num_kv_blocks=8).sampler).__name__ == \
        "KernelSampler"
    cpu, sim = results["cpu"], results["sim"]
    assert {k: [t for t, _ in v] for k, v in sim.items()} == \
        {k: [t for t, _ in v] for k, v in cpu.items()}
    for key in cpu:  # logprobs: raw logits of fp32 kernels vs numpy, not bits
        for (_, lp_cpu), (_, lp_sim) in zip(cpu[key], sim[key]):
            if lp_cpu is None:
                assert lp_sim is None
                continue
            for a, b in zip(lp_cpu, lp_sim):  # {token_id: Logprob}, sampled token first
                assert list(a) == list(b)
                for token_id, entry in a.items():
                    assert abs(entry.logprob - b[token_id].logprob) < 1e-3
                    assert entry.rank == b[token_id].rank


def test_backend_factory_and_cuda_import_guard():
    import subprocess
    import sys

    from pagedrun.runtime.backends import kernel_devices
    from pagedrun.runtime.backends import resolve_dtype

    assert resolve_dtype("sim", "auto") == "float32" and resolve_dtype("cuda", "auto") == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("sim", "int8")
    assert make_backend("cpu").name == "cpu"
    assert make_backend("sim", "float16").kv_dtype == np.float16
    # Importing the cuda backend module (as the engine does for "auto") never imports cupy.
    probe = subprocess.run([sys.executable, "-c", "import sys; import pagedrun.runtime.backends."
                            "kernel_devices; print('cupy' in sys.modules)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False"
    if not kernel_devices.cuda_available():
        with pytest.raises(kernel_devices.CudaNotAvailableError):
            kernel_devices.cuda_backend()


def test_kv_budget_arithmetic():
    from pagedrun.runtime.backends.kernel_backend import kv_cache_budget_bytes

    gib = 2**30
    # 141 GiB device, 0.9 of it, 1 GiB in use before, 16 GiB weights, 3 GiB step peak.
    assert kv_cache_budget_bytes(141 * gib, gib, 16 * gib, 3 * gib, 0.9) == \
        int(0.9 * 141 * gib) - 20 * gib
    assert kv_cache_budget_bytes(10 * gib, 0, 9 * gib, 2 * gib, 0.9) == 0  # never negative


def test_bench_model_runs_on_the_harness(capsys):
    """benchmarks/kernels/bench_model.py (the GPU e2e tokens/s table) must keep running."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_model.py"
    spec = importlib.util.spec_from_file_location("bench_model", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "sim"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip() and line.split()[0].isdigit()]
    # Each concurrency eagerly, with decode graphs (which replayed), and with graphs and
    # asynchronous scheduling.
    assert [(int(r[0]), r[1]) for r in rows] == [
        (c, mode) for c in bench.SIM_CONCURRENCY for mode in ("off", "on", "async")]
    assert all((int(r[-1]) > 0) == (r[1] != "off") for r in rows)
