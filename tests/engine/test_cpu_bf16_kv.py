"""kv_cache_dtype (vLLM's name) on the cpu bf16 / int8 backends: "auto" and "bfloat16" keep the
KV pools as uint16 bf16 bits (half the bytes per block, twice the blocks per budget), "float32"
keeps today's float32 pools; combinations a backend cannot hold are refused. The engine on the
tiny model with a bf16 cache against the same engine with a float32 one: the only difference is
k and v rounded to bf16 where they are stored (the ops themselves: tests/pyx/test_cpu_ops.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import greedy, make_engine, run_requests

from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.cpu_int8_backend import CpuInt8Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError

# A bf16 store keeps 8 significant bits (relative error <= 2^-9 per k / v element). Through the
# tiny model's spread-out logits (spread ~4, engine_helpers) that moved the logits by 0.7% of
# their spread on the float32 numpy backend, and the logprobs here by up to 0.06 nats. The bound
# is test_cpu_bf16's bf16 tolerance, 5% of the spread (0.2), plus a margin for the log-softmax
# normalizer: 0.25 nats. A real bug -- a wrong or missing key / value row, a bf16 misread (the
# bits as an integer, the wrong half) -- moves logprobs by O(1) and more.
LOGPROB_ATOL = 0.25
NUM_TOKENS = 8


def run(model, kv_cache_dtype, prompts, **config):
    engine = make_engine(model, dtype="bfloat16", block_size=8, max_num_batched_tokens=64,
                         kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=1 << 20,
                         **config)
    requests = [(0, f"r{i}", dict(prompt_token_ids=p,
                                  sampling_params=greedy(NUM_TOKENS, logprobs=5)))
                for i, p in enumerate(prompts)]
    return engine, run_requests(engine, requests)


def test_bf16_cache_halves_bytes_and_keeps_greedy_tokens(tiny_cpu_model):
    rng = np.random.default_rng(20261202)
    prompts = [rng.integers(3, tiny_cpu_model[0].vocab_size, n).tolist() for n in (5, 23, 41)]
    bf16, out16 = run(tiny_cpu_model, "bfloat16", prompts)
    fp32, out32 = run(tiny_cpu_model, "float32", prompts)
    assert bf16.backend.kv_dtype == np.uint16 and fp32.backend.kv_dtype == np.float32
    assert bf16.runner.k_caches[0].dtype == np.uint16
    assert 2 * bf16.bytes_per_block == fp32.bytes_per_block
    # One memory budget: twice the blocks (the budget is not a multiple of the block size).
    assert bf16.num_kv_blocks in (2 * fp32.num_kv_blocks, 2 * fp32.num_kv_blocks + 1)
    max_err, compared = 0.0, 0
    for rid, ref in out32.items():
        got, ref = out16[rid].outputs[0], ref.outputs[0]
        for i, (position, ref_position) in enumerate(zip(got.logprobs, ref.logprobs)):
            for token, entry in ref_position.items():
                if token in position:
                    max_err = max(max_err, abs(position[token].logprob - entry.logprob))
            # Greedy tokens agree until the float32 run's top two are within the tolerance
            # of each other (a near-tie either rounding may break); past it the contexts differ.
            top = sorted((e.logprob for e in ref_position.values()), reverse=True)
            if top[0] - top[1] <= 2 * LOGPROB_ATOL:
                break
            assert got.token_ids[i] == ref.token_ids[i]
            compared += 1
    assert compared >= NUM_TOKENS  # not vacuous: a third of the tokens at least
    assert 0 < max_err <= LOGPROB_ATOL  # close, and the cache really rounds
    for engine in (bf16, fp32):  # every block back in the pool
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_auto_kv_cache_dtype_per_backend():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert make_backend("cpu", "bfloat16").kv_dtype == np.uint16
    assert make_backend("cpu", "bfloat16", kv_cache_dtype="bfloat16").kv_dtype == np.uint16
    assert make_backend("cpu", "bfloat16", kv_cache_dtype="float32").kv_dtype == np.float32
    int8 = make_backend("cpu", "float32", quantization="int8")
    assert isinstance(int8, CpuInt8Backend) and int8.kv_dtype == np.uint16
    assert make_backend("cpu", quantization="int8", kv_cache_dtype="float32").kv_dtype == \
        np.float32
    for kv in ("auto", "float32"):
        backend = make_backend("cpu", "float32", kv_cache_dtype=kv)
        assert type(backend) is NumpyBackend and backend.kv_dtype == np.float32
    assert make_backend("sim", "float32").kv_dtype == np.float32
    assert make_backend("sim", "bfloat16", kv_cache_dtype="bfloat16").kv_dtype == np.uint16
    assert isinstance(make_backend("cpu", "bfloat16"), CpuBf16Backend)


def test_kv_cache_dtype_refusals(tiny_cpu_model):
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")  # vLLM has it; not served here
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        make_backend("cpu", "float32", kv_cache_dtype="float16")
    for device, dtype, kv in (("cpu", "float32", "bfloat16"), ("sim", "bfloat16", "float32"),
                              ("sim", "float32", "bfloat16")):
        with pytest.raises(EngineConfigError, match=f"kv_cache_dtype: '{kv}' is not served"):
            make_backend(device, dtype, kv_cache_dtype=kv)
    with pytest.raises(EngineConfigError, match="--dtype bfloat16"):  # at engine start too
        make_engine(tiny_cpu_model, dtype="float32", kv_cache_dtype="bfloat16")


def test_kv_cache_dtype_cli():
    from pagedrun.server.cli import build_parser
    from pagedrun.server.serve_cmd import engine_config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--dtype", "bfloat16", "--kv-cache-dtype", "float32"])
    assert engine_config_from_args(args).kv_cache_dtype == "float32"
    assert engine_config_from_args(parser.parse_args(["serve"])).kv_cache_dtype == "auto"
    generate = parser.parse_args(["generate", "hi", "--kv-cache-dtype", "bfloat16"])
    assert generate.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])
