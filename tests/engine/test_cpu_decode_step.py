"""The compiled decode step of the cpu bf16 / int8 backends (pagedrun.pyx.cpu_decode_step via
CpuBf16Backend.make_decode_loop): a pure-decode LlamaModel.forward through it equals the
per-op Python path bit for bit -- (x, residual) and both KV caches after the step -- on every
GEMM path, batch sizes 1 / 3 / 17 (17 rows: AMX row blocks and the two-thread split), random
non-contiguous block tables with context lengths 1, 17 and 111 (partial blocks); the engine's
greedy tokens are the same with the loop on and off; and everything it does not cover takes
the Python path (prefill rows, LoRA, other layer kinds, the loop turned off)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from engine_helpers import ENGINE_BACKENDS, EngineModel, greedy, make_engine, random_weights, \
    run_requests, tiny_config

from pagedrun.pyx import cpu_decode_step, cpu_gemm
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.cpu_int8_backend import CpuInt8Backend
from pagedrun.runtime.model_runner import build_attention_inputs
from pagedrun.runtime.models.llama import LlamaModel

PATHS = list(cpu_gemm.available_paths())  # every GEMM path this CPU runs, portable included
BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION = 16, 140, 256
# head_dim 64 (the AVX512 attention kernel's register path, GQA group 2) with q/k/v/o biases;
# and the default tiny model (head_dim 16: the masked attention path, no biases).
CONFIGS = {"hd64_bias": dict(hidden_size=256, intermediate_size=192, attention_bias=True),
           "tiny": {}}


def _caches(config, kv_dtype, rng):
    """Per layer k and v pools of random finite values (bf16 / fp8 bits or float32)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)

    def one():
        values = rng.standard_normal(shape).astype(np.float32)
        if kv_dtype == np.uint16:
            return cpu_gemm.to_bf16_bits(values)
        if kv_dtype == np.uint8:
            return rng.integers(0, 0x7F, shape).astype(np.uint8)  # finite positive e4m3
        return values

    return [one() for _ in range(config.num_hidden_layers)], [
        one() for _ in range(config.num_hidden_layers)]


def _decode_step(config, batch, rng):
    """One pure-decode step: token ids, positions, slots and AttentionInputs for `batch`
    sequences with context lengths cycling 1, 17, 111, each on random disjoint blocks."""
    lens = np.array([(1, 17, 111)[i % 3] for i in range(batch)], np.int32)
    needed = -(-lens // BLOCK_SIZE)
    blocks = rng.permutation(NUM_BLOCKS)[:needed.sum()].astype(np.int32)
    assert needed.sum() <= NUM_BLOCKS
    tables = np.full((batch, needed.max() + 2), -1, np.int32)  # padding past each table
    start = 0
    for s, n in enumerate(needed):
        tables[s, :n] = blocks[start:start + n]
        start += n
    positions = lens - 1
    slots = (tables[np.arange(batch), positions // BLOCK_SIZE] * BLOCK_SIZE
             + positions % BLOCK_SIZE).astype(np.int32)
    attn = build_attention_inputs(np.arange(batch + 1, dtype=np.int32),
                                  np.ones(batch, np.int32), lens, tables)
    assert attn.num_prefill == 0 and attn.num_decode == batch
    token_ids = rng.integers(3, config.vocab_size, batch).astype(np.int32)
    return token_ids, positions, slots, attn


def _forward_both(model, step, k_caches, v_caches):
    """(loop result, python result): forward on copies of the caches with the loop, then
    without it. Each result: (x, residual, k_caches, v_caches)."""
    results = []
    loop = model.decode_loop
    assert loop is not None
    for use_loop in (True, False):
        model.decode_loop = loop if use_loop else None
        ks, vs = [c.copy() for c in k_caches], [c.copy() for c in v_caches]
        x, residual = model.forward(*step[:3], step[3], ks, vs)
        results.append((x, residual, ks, vs))
    model.decode_loop = loop
    return results


def _assert_same(got, want):
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    for name, i in (("k", 2), ("v", 3)):
        for layer, (a, b) in enumerate(zip(got[i], want[i])):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}_cache of layer {layer}")


def _model(config_name, backend, seed=0):
    config = tiny_config(**CONFIGS[config_name])
    return LlamaModel(config, random_weights(config, seed), backend, max_position=MAX_POSITION)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("path", PATHS)
def test_loop_equals_python_path(config_name, batch, path):
    rng = np.random.default_rng(batch * 31 + len(path))
    model = _model(config_name, CpuBf16Backend(path=path))
    k_caches, v_caches = _caches(model.config, np.uint16, rng)
    got, want = _forward_both(model, _decode_step(model.config, batch, rng), k_caches, v_caches)
    _assert_same(got, want)
    # The step wrote its tokens' K/V (the caches are not simply left alone by both).
    assert any((a != b).any() for a, b in zip(got[2], k_caches))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "fp8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_loop_other_kv_dtypes_and_one_thread(kv_cache_dtype, threads):
    rng = np.random.default_rng(7)
    backend = CpuBf16Backend(kv_cache_dtype=kv_cache_dtype, gemm_threads=threads)
    model = _model("hd64_bias", backend)
    k_caches, v_caches = _caches(model.config, backend.kv_dtype, rng)
    got, want = _forward_both(model, _decode_step(model.config, 17, rng), k_caches, v_caches)
    _assert_same(got, want)


@pytest.mark.parametrize("batch", [1, 17])
@pytest.mark.parametrize("path", ["auto", "portable"])
def test_loop_int8_weights(batch, path):
    rng = np.random.default_rng(batch)
    model = _model("hd64_bias", CpuInt8Backend(path=path))
    assert isinstance(model.layers[0].qkv, cpu_gemm.PackedGgufWeight)  # Q8_0 (issue 35)
    k_caches, v_caches = _caches(model.config, np.uint16, rng)
    got, want = _forward_both(model, _decode_step(model.config, batch, rng), k_caches, v_caches)
    _assert_same(got, want)


def test_loop_grows_buffers_and_rebinds_caches():
    """Batch 1, then 17 (the work buffers grow), then 3 on other cache arrays (rebound)."""
    rng = np.random.default_rng(3)
    model = _model("hd64_bias", CpuBf16Backend())
    assert model.decode_loop.capacity < 17
    for batch in (1, 17, 3):
        k_caches, v_caches = _caches(model.config, np.uint16, rng)
        got, want = _forward_both(model, _decode_step(model.config, batch, rng), k_caches,
                                  v_caches)
        _assert_same(got, want)
    assert model.decode_loop.capacity >= 17


def test_loop_checks_indices():
    rng = np.random.default_rng(5)
    model = _model("tiny", CpuBf16Backend())
    k_caches, v_caches = _caches(model.config, np.uint16, rng)
    token_ids, positions, slots, attn = _decode_step(model.config, 3, rng)
    x = model.embed(token_ids)
    loop = model.decode_loop
    with pytest.raises(ValueError, match="slot"):
        loop(x, positions, np.full(3, NUM_BLOCKS * BLOCK_SIZE, np.int32),
             attn.decode_block_tables, attn.decode_context_lens, k_caches, v_caches)
    with pytest.raises(ValueError, match="block id"):
        loop(x, positions, slots, np.full_like(attn.decode_block_tables, NUM_BLOCKS),
             attn.decode_context_lens, k_caches, v_caches)
    with pytest.raises(ValueError, match="positions"):
        loop(x, positions + MAX_POSITION, slots, attn.decode_block_tables,
             attn.decode_context_lens, k_caches, v_caches)


@pytest.mark.parametrize("path", PATHS)
def test_gemm_equals_cpu_gemm(path):
    """cpu_decode_step.gemm (the backend's GEMM while the loop is on) == cpu_gemm's native-pool
    GEMM bit for bit: bf16 and int8 weights, 1 / 8 / 33 rows (AMX row blocks), strided x,
    bias or not, one thread or two."""
    rng = np.random.default_rng(len(path))
    for n, k in ((40, 64), (1000, 576), (300, 1537)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        for packed in (cpu_gemm.PackedWeight(w), cpu_gemm.PackedInt8Weight(w)):
            for m in (1, 8, 33):
                x = rng.standard_normal((k, m)).astype(np.float32).T  # strided
                for b in (None, bias):
                    for threads in (1, 2):
                        np.testing.assert_array_equal(
                            cpu_decode_step.gemm(x, packed, b, path=path, threads=threads),
                            cpu_gemm.gemm_bf16(x, packed, b, path=path, threads=threads))


def test_backend_linear_uses_the_loop_gemm_only_with_the_loop():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    calls = []
    for flag in (True, False):
        backend = CpuBf16Backend(decode_loop=flag)
        backend.gemm = lambda *a, **kw: calls.append(flag) or cpu_gemm.gemm_bf16(*a, **kw)
        np.testing.assert_array_equal(backend.linear(x, backend.linear_weight(w)),
                                      cpu_gemm.gemm_bf16(x, cpu_gemm.PackedWeight(w)))
    assert calls == [False]  # with the loop on, cpu_decode_step.gemm ran instead


class _Refuse:
    """A decode loop that must not be called."""

    def __call__(self, *args):
        raise AssertionError("the decode loop ran where the Python path must")


def test_prefill_and_lora_steps_take_the_python_path():
    rng = np.random.default_rng(11)
    model = _model("tiny", CpuBf16Backend())
    k_caches, v_caches = _caches(model.config, np.uint16, rng)
    model.decode_loop = _Refuse()
    # A step with a prefill row (and a decode row).
    lens = np.array([5, 9], np.int32)
    tables = np.array([[3, 4], [7, 8]], np.int32)
    attn = build_attention_inputs(np.array([0, 1, 5], np.int32), np.array([1, 4], np.int32),
                                  lens, tables)
    assert attn.num_prefill == 1
    positions = np.array([4, 5, 6, 7, 8], np.int32)
    slots = np.array([3 * 16 + 4, 7 * 16 + 5, 7 * 16 + 6, 7 * 16 + 7, 7 * 16 + 8], np.int32)
    model.forward(np.arange(3, 8, dtype=np.int32), positions, slots, attn, k_caches, v_caches)
    # A decode step with LoRA (adapters without targets here: deltas none, path Python).
    step = _decode_step(model.config, 3, rng)
    lora = SimpleNamespace(stack=SimpleNamespace(module=lambda index, target: None), batch=None)
    model.forward(*step[:3], step[3], k_caches, v_caches, lora=lora)
    # A pipeline stage's input.
    x = model.embed(step[0])
    model.forward(*step[:3], step[3], k_caches, v_caches, hidden=(x, x.copy()))


def test_backend_offers_a_loop_only_where_it_applies():
    config = tiny_config()
    weights = random_weights(config)

    def loop_of(backend, config=config):
        return LlamaModel(config, weights, backend, max_position=MAX_POSITION).decode_loop

    assert loop_of(CpuBf16Backend()) is not None
    assert loop_of(CpuBf16Backend(decode_loop=False)) is None
    assert loop_of(CpuBf16Backend(gemm_pool="python")) is None

    class OwnLinear(CpuBf16Backend):  # as CpuGgufBackend: its GEMMs are its own
        def linear(self, x, weight, bias=None, *, out_dtype=None):
            return super().linear(x, weight, bias, out_dtype=out_dtype)

    assert loop_of(OwnLinear()) is None
    # GeGLU, and a sliding window on every layer: per-op path.
    gelu = dataclasses.replace(config, hidden_activation="gelu_pytorch_tanh")
    assert loop_of(CpuBf16Backend(), gelu) is None
    model = LlamaModel(config, weights, CpuBf16Backend(), max_position=MAX_POSITION)
    model.layers[0].sliding_window = 8
    assert CpuBf16Backend().make_decode_loop(model) is None

    class Subclass(LlamaModel):  # tensor parallelism's ShardedLlamaModel is one
        pass

    assert Subclass(config, weights, CpuBf16Backend(), max_position=MAX_POSITION).decode_loop \
        is None


def test_engine_greedy_same_with_and_without_loop():
    """Several requests over several steps (prefills, mixed and pure-decode steps): greedy
    tokens equal with the loop on and off, and the loop ran on the pure-decode steps."""
    backend = ENGINE_BACKENDS["cpu-bf16"]
    config = tiny_config(**backend.model_overrides)
    model = EngineModel(config, random_weights(config, seed=4), backend)
    rng = np.random.default_rng(9)
    requests = [(i // 2, f"r{i}", dict(
        prompt_token_ids=rng.integers(3, config.vocab_size, int(rng.integers(1, 40))).tolist(),
        sampling_params=greedy(int(rng.integers(5, 20))))) for i in range(6)]
    outputs = []
    for use_loop in (True, False):
        engine = make_engine(model, kv_cache_dtype="bfloat16", block_size=8,
                             max_num_batched_tokens=48)
        runner_model = engine.runner.model
        loop = runner_model.decode_loop
        assert loop is not None
        calls = []

        def counted(*args, loop=loop, calls=calls):
            calls.append(args[0].shape[0])
            return loop(*args)

        runner_model.decode_loop = counted if use_loop else None
        done = run_requests(engine, requests)
        outputs.append({rid: out.outputs[0].token_ids for rid, out in done.items()})
        if use_loop:
            assert len(calls) >= 5 and max(calls) >= 3
    assert outputs[0] == outputs[1]
