"""float32 -> bfloat16 rounding: one rule (round to nearest even; NaN stays a quiet NaN with its
sign) and every path that rounds agrees with it bit for bit.

Paths: weights.to_bf16_bits (the one Python implementation; kernel_args re-exports it),
numpy_ops.round_to_bf16, cpu_gemm's C++ f32_to_bf16 (cpu_gemm.to_bf16_bits, the weight packing,
the per-call activation conversion), and the CPU kernel harness's __float2bfloat16_rn
(cuda/sim/fp16.cuh). The widening bf16 -> float32 (from_bf16_bits, the safetensors loader) is
exact.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedrun.runtime.backends import numpy_ops
from pagedrun.runtime.kernels import kernel_args
from pagedrun.runtime.weights import from_bf16_bits, to_bf16_bits

SIM_TEST_KERNELS = Path(__file__).resolve().parents[1] / "sim" / "kernels"

# float32 bit patterns the rule has to get right (each also tested with the sign bit flipped).
SPECIAL_BITS = [
    0x00000000,  # +0 (and -0)
    0x00000001,  # smallest subnormal: rounds to 0
    0x00008000,  # subnormal tie at 0: stays 0 (even)
    0x00018000,  # subnormal tie above an odd bf16: rounds up to 0x0002
    0x00008001,  # just above a tie: up
    0x007FFFFF,  # largest subnormal: rounds up into the smallest normal
    0x00800000,  # smallest normal
    0x3F800000,  # 1.0
    0x3F808000,  # 1 + 2^-8, tie between 1 and 1 + 2^-7: stays 1 (even)
    0x3F818000,  # tie above an odd bf16: up
    0x3F807FFF,  # just below a tie: down
    0x3FFFFFFF,  # rounds up across the exponent
    0x7F7F7FFF,  # below the largest bf16's rounding edge: the largest bf16
    0x7F7F8000,  # tie at the largest bf16 (odd): overflows to inf
    0x7F7FFFFF,  # float32 max: overflows to inf
    0x7F800000,  # inf
    0x7F800001,  # signaling NaN, tiny payload (the bias would make it inf)
    0x7F80FFFF,  # signaling NaN whose payload carries
    0x7FC00000,  # canonical quiet NaN
    0x7FFFFFFF,  # NaN, all payload bits
    0x7FBF8000,  # signaling NaN with upper payload bits
]


def expected_bits(bits: np.ndarray) -> np.ndarray:
    """The rule, spelled out one integer at a time (independent of the vectorised code)."""
    out = []
    for b in bits.astype(np.uint32).tolist():
        if (b & 0x7FFFFFFF) > 0x7F800000:            # NaN: quiet, sign and top payload kept
            out.append((b >> 16) | 0x0040)
            continue
        upper, lower = b >> 16, b & 0xFFFF
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1                                # carries into the exponent: max -> inf
        out.append(upper)
    return np.array(out, dtype=np.uint16)


@pytest.fixture(scope="module")
def values() -> np.ndarray:
    """float32 values: the specials (both signs), then random bit patterns of every kind."""
    rng = np.random.default_rng(20260211)
    special = np.array(SPECIAL_BITS, dtype=np.uint32)
    special = np.concatenate([special, special | np.uint32(0x80000000)])
    uniform = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    # Values whose dropped half is exactly a tie, or one ulp either side of it.
    near_tie = (rng.integers(0, 2**16, size=3000, dtype=np.uint64).astype(np.uint32) << 16) \
        | rng.choice(np.array([0x7FFF, 0x8000, 0x8001], np.uint32), size=3000)
    subnormal = rng.integers(0, 0x00800000, size=2000, dtype=np.uint64).astype(np.uint32)
    normal = rng.standard_normal(5000).astype(np.float32).view(np.uint32)
    bits = np.concatenate([special, uniform, near_tie, subnormal, normal])
    return bits.view(np.float32)


def test_python_rounding_is_the_rule(values):
    assert kernel_args.to_bf16_bits is to_bf16_bits       # one implementation, re-exported
    assert kernel_args.from_bf16_bits is from_bf16_bits
    want = expected_bits(values.view(np.uint32))
    got = to_bf16_bits(values)
    assert got.dtype == np.uint16 and got.shape == values.shape
    np.testing.assert_array_equal(got, want)
    # Shape kept, any float dtype accepted (cast to float32 first).
    assert to_bf16_bits(values.reshape(-1, 2)[:5]).shape == (5, 2)
    assert to_bf16_bits(np.array([1.0], np.float64)).tolist() == [0x3F80]


def as_f32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


def test_rule_spot_checks():
    got = to_bf16_bits(as_f32(0x80000000, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF,
                              0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000))
    assert got.tolist() == [0x8000, 0x3F80, 0x3F82, 0x7F80, 0xFF80,
                            0x7FC0, 0xFFC0, 0x7FC0, 0xFF80]
    nan_bits = to_bf16_bits(as_f32(0x7F800001, 0xFF800001, 0x7FFFFFFF))
    widened = from_bf16_bits(nan_bits)
    assert np.isnan(widened).all() and (nan_bits & 0x0040).all()        # quiet
    assert np.signbit(widened).tolist() == [False, True, False]           # sign kept


def test_numpy_ops_round_to_bf16_agrees(values):
    rounded = numpy_ops.round_to_bf16(values)
    assert rounded.dtype == np.float32
    bits = rounded.view(np.uint32)
    assert not (bits & np.uint32(0xFFFF)).any()   # a bf16 value: the low half is zero
    np.testing.assert_array_equal((bits >> np.uint32(16)).astype(np.uint16),
                                  expected_bits(values.view(np.uint32)))


def test_widening_is_exact_and_round_trips():
    every_bf16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    widened = from_bf16_bits(every_bf16)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened.view(np.uint32),
                                  every_bf16.astype(np.uint32) << np.uint32(16))
    # bf16 values round to themselves, except NaNs, which come back quiet.
    back = to_bf16_bits(widened)
    is_nan = np.isnan(widened)
    np.testing.assert_array_equal(back[~is_nan], every_bf16[~is_nan])
    np.testing.assert_array_equal(back[is_nan], every_bf16[is_nan] | np.uint16(0x0040))


def test_safetensors_loader_widens_bf16_exactly(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from pagedrun.runtime.weights import SafetensorsCheckpoint

    raw = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    spec = safetensors.TensorSpec(dtype="bfloat16", shape=list(raw.shape),
                                  data_ptr=raw.ctypes.data, data_len=raw.nbytes)
    safetensors.serialize_file({"w": spec}, str(tmp_path / "model.safetensors"))
    loaded = SafetensorsCheckpoint(tmp_path).get("w")
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded.view(np.uint32), raw.astype(np.uint32) << np.uint32(16))


def test_cpu_gemm_cpp_rounding_agrees(values):
    cpu_gemm = pytest.importorskip("pagedrun.pyx.cpu_gemm")
    want = expected_bits(values.view(np.uint32))
    # cpu_gemm.to_bf16_bits: the C++ f32_to_bf16 (pyx/ may not import runtime/), same shape.
    np.testing.assert_array_equal(cpu_gemm.to_bf16_bits(values), want)
    assert cpu_gemm.to_bf16_bits(values[:6].reshape(2, 3)).shape == (2, 3)
    assert cpu_gemm.to_bf16_bits(np.zeros(0, np.float32)).shape == (0,)
    # The activation conversion of every gemm_bf16 call (rows of 64, zero padding past K).
    k = 64
    x = values[: len(values) // k * k].reshape(-1, k)
    got = cpu_gemm._convert(x, k)
    np.testing.assert_array_equal(got.reshape(-1), want[: x.size])
    # Strided rows take the other loop of convert_rows.
    got_t = cpu_gemm._convert(x.T[:, :5], 6)
    np.testing.assert_array_equal(got_t[:, :5], want[: x.size].reshape(-1, k).T[:, :5])
    assert not got_t[:, 5].any()
    # Weight packing: PackedWeight holds to_bf16_bits(W) in its tiled layout.
    w = values[:48 * 32].reshape(48, 32)
    packed = cpu_gemm.PackedWeight(w)
    tiles, kp, tile_n, _ = packed.packed.shape
    unpacked = packed.packed.transpose(0, 2, 1, 3).reshape(tiles * tile_n, kp * 2)
    np.testing.assert_array_equal(unpacked[:48, :32], want[: w.size].reshape(48, 32))


def test_kernel_harness_agrees(values):
    from pagedrun.runtime.kernels.sim_module import CUDA_DIR, SimBuildError, SimModule

    try:
        module = SimModule('#include "smoke.cu"\n', include_dirs=(CUDA_DIR, SIM_TEST_KERNELS))
    except SimBuildError as exc:  # no host compiler here
        pytest.skip(f"CPU kernel harness unavailable: {exc}")
    n = len(values)
    half, bits = np.empty(n, np.uint16), np.empty(n, np.uint16)
    half_f32, bits_f32 = np.empty(n, np.float32), np.empty(n, np.float32)
    module.get_function("convert_halves")((-(-n // 256),), (256,),
                                          (values, half, bits, half_f32, bits_f32, np.int32(n)))
    np.testing.assert_array_equal(bits, expected_bits(values.view(np.uint32)))
    np.testing.assert_array_equal(bits_f32.view(np.uint32), from_bf16_bits(bits).view(np.uint32))
