"""The bf16-weight cpu backend: pagedrun.pyx.cpu_gemm against a float64 numpy product of the
same bf16-rounded inputs (both code paths, forced), and the engine on dtype "bfloat16" against
the float32 numpy backend (logits within bf16 tolerance, greedy text of the default model, also
with int8 weights)."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import greedy, make_engine, prefill_logits, run_requests

from pagedrun.pyx import cpu_gemm
from pagedrun.runtime.backends import make_backend
from pagedrun.runtime.backends.cpu_bf16_backend import CpuBf16Backend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend

PATHS = list(cpu_gemm.available_paths())  # every path this CPU runs, portable included
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def bf16_values(x: np.ndarray) -> np.ndarray:
    """The float64 values of x rounded to bf16 (the kernel's inputs)."""
    bits = cpu_gemm.to_bf16_bits(x).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(np.float64)


def check_gemm(y, x, w, bias):
    """y against float64 bf16(x) @ bf16(w).T + bias. The products of bf16 values are exact in
    float32, so the error is float32 summation only: |err| <= gamma_(K+1) * sum |x_k w_k| + |b|,
    gamma_n = n u / (1 - n u) (Higham), doubled for the pairwise adds of vdpbf16ps."""
    xv, wv = bf16_values(x), bf16_values(w)
    ref = xv @ wv.T
    abs_sum = np.abs(xv) @ np.abs(wv).T
    if bias is not None:
        ref += bias.astype(np.float64)
        abs_sum += np.abs(bias.astype(np.float64))
    n = x.shape[1] + 2
    bound = 2 * n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF) * abs_sum + 1e-30
    assert y.dtype == np.float32 and y.shape == ref.shape
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 17, 111])
@pytest.mark.parametrize("n", [1, 17, 1000])
@pytest.mark.parametrize("k", [1, 64, 576, 1537])
def test_gemm_shapes(rng, path, m, n, k):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if (m + n + k) % 2 else None
    packed = cpu_gemm.PackedWeight(w)
    for threads, pool in ((1, "native"), (2, "native"), (2, "python")):
        check_gemm(cpu_gemm.gemm_bf16(x, packed, bias, path=path, threads=threads, pool=pool),
                   x, w, bias)


@pytest.mark.skipif(not cpu_gemm.has_amx(), reason="this CPU has no AMX-BF16 (or the kernel "
                    "refused the tile state): the amx path cannot run here")
@pytest.mark.parametrize("m", [7, 8, 16, 31, 32, 33, 64])
@pytest.mark.parametrize("n", [16, 40, 200])
@pytest.mark.parametrize("k", [32, 96, 576, 40])
def test_amx_row_blocks_tiles_and_fallbacks(rng, m, n, k):
    """The AMX kernel's edges: one or two 16-row blocks, a partial last block (padded rows
    computed, never stored), an odd number of weight tiles and a partial last tile; below
    AMX_MIN_ROWS rows or with K not a multiple of 32 it takes the AVX512 kernels (k = 40)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if m % 2 else None
    packed = cpu_gemm.PackedWeight(w)
    for threads in (1, 2):
        check_gemm(cpu_gemm.gemm_bf16(x, packed, bias, path="amx", threads=threads), x, w, bias)


def test_amx_detection_matches_the_cpu():
    """A CPU whose flags list AMX-BF16 and AMX tiles gets the amx path (the kernel's
    permission for the tile state granted): a refusal here would silently cost 2-5x at
    batches of 8 and more."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    cpu_says = {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags)
    assert cpu_gemm.has_amx() == cpu_says
    assert ("amx" in cpu_gemm.available_paths()) == cpu_says


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_gemm_decode_rows(rng, path, m):
    # M 1-4 take the streaming decode kernel (one or two tiles, full K, two accumulator sets),
    # M 5 the blocked one: odd K (the odd last pair), N with a partial tile after an odd tile
    # count (the one-tile remainder), and the threaded split.
    for n, k in ((33, 577), (16, 2), (1000, 64), (49, 1)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32) if n % 2 else None
        packed = cpu_gemm.PackedWeight(w)
        for threads in (1, 2):
            check_gemm(cpu_gemm.gemm_bf16(x, packed, bias, path=path, threads=threads), x, w,
                       bias)


def test_gemm_helper_handoff_sleeps_wakes_and_serializes(rng):
    # The native helper polls for work for a while after a job, then sleeps: calls back to back,
    # after a pause past the poll window, and from several Python threads at once (one split at
    # a time) must all give the one-thread result bit for bit (the split changes which thread
    # computes a tile, not its arithmetic).
    import threading
    import time

    x = rng.standard_normal((3, 200)).astype(np.float32)
    packed = cpu_gemm.PackedWeight(rng.standard_normal((700, 200)).astype(np.float32))
    want = cpu_gemm.gemm_bf16(x, packed, threads=1)
    for pause in (0.0, 0.0, 0.002, 0.0, 0.002):
        time.sleep(pause)
        np.testing.assert_array_equal(cpu_gemm.gemm_bf16(x, packed, threads=2), want)
    failures = []

    def caller():
        for _ in range(20):
            if not np.array_equal(cpu_gemm.gemm_bf16(x, packed, threads=2), want):
                failures.append(1)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


@pytest.mark.parametrize("path", PATHS)
def test_gemm_bias_strided_and_unaligned_inputs(rng, path):
    k, n = 131, 77
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    packed = cpu_gemm.PackedWeight(w)
    big = rng.standard_normal((40, 2 * k + 3)).astype(np.float32)
    strided = big[::3, 1:2 * k + 1:2]                     # both strides non-unit
    check_gemm(cpu_gemm.gemm_bf16(strided, packed, bias, path=path), strided, w, bias)
    raw = np.empty(9 * k * 4 + 4, dtype=np.uint8)[4:]    # 4-byte but not 64-byte aligned
    unaligned = raw.view(np.float32).reshape(9, k)
    unaligned[:] = rng.standard_normal((9, k))
    check_gemm(cpu_gemm.gemm_bf16(unaligned, packed, bias, path=path), unaligned, w, bias)
    transposed_w = np.asfortranarray(w)                   # a weight view like llama.py's w_t.T
    check_gemm(cpu_gemm.gemm_bf16(strided, cpu_gemm.PackedWeight(transposed_w), None,
                                  path=path), strided, w, None)


def test_gemm_paths_agree_and_rounding_is_rne(rng):
    # 1 + 2^-8 is a bf16 tie between 1 and 1 + 2^-7: RNE keeps the even 1.0.
    x = np.array([[1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]], np.float32)
    assert cpu_gemm.to_bf16_bits(x).tolist() == [[0x3F80, 0x3F82]]
    packed = cpu_gemm.PackedWeight(np.array([[1.0, 0.0], [0.0, 1.0]], np.float32))
    for path in PATHS:
        y = cpu_gemm.gemm_bf16(x, packed, path=path)
        assert y.tolist() == [[1.0, 1.0 + 2.0 ** -6]]
    xr = rng.standard_normal((13, 300)).astype(np.float32)
    wr = cpu_gemm.PackedWeight(rng.standard_normal((70, 300)).astype(np.float32))
    ys = [cpu_gemm.gemm_bf16(xr, wr, path=p) for p in PATHS]
    for y in ys[1:]:
        np.testing.assert_allclose(y, ys[0], rtol=1e-5, atol=1e-5)


def test_gemm_rejects_bad_arguments(rng):
    packed = cpu_gemm.PackedWeight(rng.standard_normal((8, 6)).astype(np.float32))
    with pytest.raises(ValueError, match="x must be"):
        cpu_gemm.gemm_bf16(np.zeros((2, 5), np.float32), packed)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_gemm.gemm_bf16(np.zeros((2, 6), np.float32), packed, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="pool must be"):
        cpu_gemm.gemm_bf16(np.zeros((2, 6), np.float32), packed, pool="omp")
    with pytest.raises(ValueError, match="path must be"):
        cpu_gemm.gemm_bf16(np.zeros((2, 6), np.float32), packed, path="avx9")


def test_make_backend_cpu_dtypes():
    assert isinstance(make_backend("cpu", "bfloat16"), CpuBf16Backend)
    for dtype in ("auto", "float32"):
        backend = make_backend("cpu", dtype)
        assert type(backend) is NumpyBackend and backend.dtype_name == "float32"


# bf16 rounds each GEMM input to 8 significant bits (relative error 2^-9); through the tiny
# model's 2 layers and LM head that measured ~2% of the logits' spread. 5% of the spread bounds
# it with margin and still fails a wrong kernel (a dropped K pair or tile moves logits by ~100%).
BF16_LOGIT_TOLERANCE = 0.05


@pytest.mark.parametrize("path", PATHS)
def test_tiny_model_logits_close_to_float32(tiny_cpu_model, rng, path):
    tokens = rng.integers(3, tiny_cpu_model[0].vocab_size, 37).tolist()
    ref = prefill_logits(*tiny_cpu_model, NumpyBackend(), tokens)
    got = prefill_logits(*tiny_cpu_model, CpuBf16Backend(path=path), tokens)
    assert got.dtype == np.float32 and got.shape == ref.shape
    spread = float(ref.std())
    assert np.max(np.abs(got - ref)) <= BF16_LOGIT_TOLERANCE * spread
    assert np.max(np.abs(got - ref)) > 0  # the bf16 path really rounds


def test_tiny_engine_bfloat16_runs_batched(tiny_cpu_model, rng):
    engine = make_engine(tiny_cpu_model, dtype="bfloat16", block_size=8, max_num_batched_tokens=40)
    assert isinstance(engine.backend, CpuBf16Backend)
    prompts = [rng.integers(3, tiny_cpu_model[0].vocab_size, n).tolist() for n in (5, 23, 61, 2)]
    requests = [(i, f"r{i}", dict(prompt_token_ids=p, sampling_params=greedy(9)))
                for i, p in enumerate(prompts)]
    outputs = run_requests(engine, requests)
    float32 = make_engine(tiny_cpu_model, block_size=8, max_num_batched_tokens=40)
    ref = run_requests(float32, requests)
    agree = 0
    for rid, out in outputs.items():
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 9
        agree += tokens[:3] == ref[rid].outputs[0].token_ids[:3]
    # The tiny model's logits are spread (engine_helpers): bf16 keeps the first greedy tokens.
    assert agree >= len(prompts) - 1


@pytest.mark.parametrize("weights", [{"dtype": "bfloat16"}, {"quantization": "int8"}],
                         ids=["bfloat16", "int8"])
def test_default_model_greedy_answer(weights):
    from pagedrun import LLM
    from pagedrun.runtime.errors import ModelLoadError
    from pagedrun.runtime.sampling_params import SamplingParams

    try:
        llm = LLM(device="cpu", max_model_len=256, **weights)
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(temperature=0.0, max_tokens=16))
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."


@pytest.mark.parametrize("context_lens", [[1, 17, 40, 33, 16], [5, 5], [3, 200, 7]])
def test_batched_decode_attention_matches_numpy_ops(rng, context_lens):
    from pagedrun.runtime.backends import numpy_ops

    num_seqs, num_heads, num_kv_heads, head_dim, block_size = len(context_lens), 9, 3, 64, 16
    num_blocks = 64
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(
        np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    max_blocks = 15
    block_tables = np.zeros((num_seqs, max_blocks), np.int32)
    perm = rng.permutation(num_blocks)
    used = 0
    for i, n in enumerate(context_lens):
        nb = -(-n // block_size)
        block_tables[i, :nb] = perm[used:used + nb]
        used += nb
    q = rng.standard_normal((num_seqs, num_heads, head_dim)).astype(np.float32)
    lens = np.array(context_lens, np.int32)
    ref = numpy_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    got = CpuBf16Backend.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("pool", cpu_gemm.POOLS)
def test_gemm_threaded_after_fork(rng, pool):
    """A forked child (the helper thread is not copied) still gets its threaded GEMM."""
    import os

    x = rng.standard_normal((64, 256)).astype(np.float32)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    packed = cpu_gemm.PackedWeight(w)
    expected = cpu_gemm.gemm_bf16(x, packed, threads=2, pool=pool)  # helper up in the parent
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: exit code 0 only if the threaded call finished and matched
        ok = False
        try:
            ok = np.array_equal(cpu_gemm.gemm_bf16(x, packed, threads=2, pool=pool), expected)
        finally:
            os.write(write_fd, b"1" if ok else b"0")
            os._exit(0)
    os.close(write_fd)
    import select

    ready, _, _ = select.select([read_fd], [], [], 60)
    result = os.read(read_fd, 1) if ready else b""
    os.close(read_fd)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert result == b"1"


@pytest.mark.parametrize("fixture,dtype,want", [
    ("llama_tied_bf16", "auto", "bfloat16"),    # its own precision (backends.checkpoint_dtype)
    ("llama_tied_bf16", "float32", "float32"),  # the reference, one flag away
    ("mistral_fp16", "auto", "float32"),        # no float16 cpu backend: float32 holds it
    ("qwen2_tied", "auto", "float32"),          # a float32 checkpoint
])
def test_dtype_auto_serves_the_checkpoints_precision(fixture, dtype, want, caplog):
    from pathlib import Path

    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig

    model = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / fixture
    with caplog.at_level("INFO", logger="pagedrun.engine"):
        engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype=dtype,
                                        num_kv_blocks=8, max_model_len=64))
    assert engine.model_info()["dtype"] == want
    said = any("the checkpoint's own precision" in r.getMessage() for r in caplog.records)
    assert said == (dtype == "auto" and want != "float32")
