"""GGUF IQ4_NL kept quantized (runtime/quantization/gguf_iq4_nl.py): the repack to Q8_0 against
gguf's own IQ4_NL dequantization (bit for bit, any finite fp16 d), the gguf method routing it,
the cpu GEMM on it within the bound its activation rounding allows, and a .gguf file with
IQ4_NL matrices (fused with Q8_0 parts, q/k rows permuted, the embedding table) served end to
end with no matrix dequantized. gguf-py has no IQ4_NL quantizer: blocks are random bytes, or a
nearest-value quantizer written here for the file."""
from __future__ import annotations

import numpy as np
import pytest

import pagedrun_tests_tiny_gguf as tiny_gguf
from engine_helpers import fake_quantize_rows, prefill_logits

from pagedrun.pyx import cpu_gemm
from pagedrun.runtime.backends.cpu_gguf_backend import CpuGgufBackend
from pagedrun.runtime.backends.numpy_backend import NumpyBackend
from pagedrun.runtime.model_loader import load_model
from pagedrun.runtime.quantization import QuantizedMatrix, get_method

gguf = pytest.importorskip("gguf")

FP32_UNIT_ROUNDOFF = 2.0 ** -24
BLOCK = 32
IQ4_NL_BYTES = 18  # fp16 d, 16 bytes of nibbles per block
# Awkward sizes: one output / a partial 16-output tile; 1 and 7 blocks a row.
SHAPES = [(1, 32), (19, 224), (111, 96)]


@pytest.fixture
def rng():
    return np.random.default_rng(20261207)


def random_iq4_nl(rng, n: int, k: int, wild: bool) -> np.ndarray:
    """uint8 [n, k / 32 * 18]: random nibbles; d any finite fp16 (subnormals, negatives, 0,
    65504) when wild, else a weight-like scale."""
    raw = rng.integers(0, 256, (n, k // BLOCK, IQ4_NL_BYTES), dtype=np.uint8)
    if wild:
        bits = rng.integers(0, 1 << 16, (n, k // BLOCK), dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    else:
        bits = rng.uniform(1e-3, 2e-2, (n, k // BLOCK)).astype(np.float16).view(np.uint16)
    raw[:, :, 0:2] = bits.view(np.uint8).reshape(n, k // BLOCK, 2)
    return raw.reshape(n, -1)


def iq4_nl_dequantized(raw: np.ndarray, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.IQ4_NL).reshape(-1, k)


@pytest.mark.parametrize("n,k", SHAPES)
def test_repack_holds_the_same_values(rng, n, k):
    raw = random_iq4_nl(rng, n, k, wild=True)
    matrix = QuantizedMatrix("IQ4_NL", (n, k), raw)
    served = get_method("gguf").kernel_form(matrix)
    assert served.ggml_type == "Q8_0" and served.shape == (n, k)
    assert served.raw.shape == (n, k // BLOCK * 34)
    want = iq4_nl_dequantized(raw, k).astype(np.float32)
    got = gguf.quants.dequantize(served.raw, gguf.GGMLQuantizationType.Q8_0).reshape(n, k)
    assert np.array_equal(got.astype(np.float32).view(np.uint32), want.view(np.uint32))
    # ... and so does the kernel's packed form of it.
    packed = cpu_gemm.PackedGgufWeight(served.raw, served.ggml_type, k)
    assert np.array_equal(packed.dequantize().view(np.uint32), want.view(np.uint32))
    # The container's own dequantization is unchanged (gguf's IQ4_NL).
    assert np.array_equal(matrix.dequantize().view(np.uint32), want.view(np.uint32))


def test_repack_refuses_a_partial_block():
    from pagedrun.runtime.quantization.gguf_iq4_nl import iq4_nl_as_q8_0

    with pytest.raises(ValueError, match="IQ4_NL rows"):
        iq4_nl_as_q8_0(np.zeros((2, 17), np.uint8))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5])
def test_gemm_is_the_quantized_arithmetic(rng, n, k, m):
    """The backend's GEMM on an IQ4_NL weight: kept quantized (no bf16 fallback), and within
    the q8x2 activation-rounding bound of the float64 product of gguf's dequantized weights:
    each activation moves by at most dx / 256 (+ u dx / 2 for the residual's float32
    rounding), dx = max |block| / 127; plus the float32 accumulation of the per-block
    products, (2 nb + 4) u times their magnitudes (taken as twice |x| |W|, the activations'
    rounding being far below that)."""
    raw = random_iq4_nl(rng, n, k, wild=False)
    backend = CpuGgufBackend(kv_cache_dtype="float32", activations="q8x2")
    weight = get_method("gguf").create_weights(backend, QuantizedMatrix("IQ4_NL", (n, k), raw))
    assert isinstance(weight, cpu_gemm.PackedGgufWeight) and weight.ggml_type == "Q8_0"
    assert backend.dequantized_types == set()
    x = rng.standard_normal((m, k)).astype(np.float32) * np.float32(3.0)
    if k > BLOCK:
        x[0, :BLOCK] = 0.0  # an all-zero activation block: dx 0
    y = backend.linear(x, weight)
    assert y.shape == (m, n) and y.dtype == np.float32
    w = iq4_nl_dequantized(raw, k).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    dx = np.abs(x.reshape(m, k // BLOCK, BLOCK)).max(axis=2).astype(np.float64) / 127
    absw = np.abs(w).reshape(n, k // BLOCK, BLOCK).sum(axis=2)
    act_bound = (1.0 / 256 + FP32_UNIT_ROUNDOFF / 2) * dx @ absw.T
    nb = k // BLOCK
    slack = 2 * (2 * nb + 4) * FP32_UNIT_ROUNDOFF * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= act_bound + slack).all(), float((err - act_bound - slack).max())
    # The activation rounding is really what separates them (the bound is not vacuous).
    assert err.max() > 0


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_NL rows: d = max |block| / 127 (fp16), each weight the table
    entry nearest w / d. Any such bytes are a valid IQ4_NL matrix; this just makes the tiny
    model's weights resemble its float ones."""
    table = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)
    n, k = values.shape
    blocks = values.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float16)
    safe = np.where(d == 0, np.float32(1), d.astype(np.float32))[:, :, None]
    index = np.abs(blocks[..., None] / safe[..., None] - table).argmin(axis=3).astype(np.uint8)
    raw = np.empty((n, k // BLOCK, IQ4_NL_BYTES), np.uint8)
    raw[:, :, 0:2] = d.view(np.uint8).reshape(n, k // BLOCK, 2)
    raw[:, :, 2:] = index[:, :, :16] | (index[:, :, 16:] << np.uint8(4))
    return raw.reshape(n, -1)


@pytest.fixture
def iq4_nl_gguf(tmp_path, monkeypatch):
    """A tiny Llama .gguf with IQ4_NL matrices: q/k/v all IQ4_NL (q/k rows permuted), gate
    IQ4_NL with up Q8_0 (fused after the repack), o / down IQ4_NL, the embedding table too,
    tied to the LM head (an untied head would be the writer's F16, packed bf16 on this
    backend: its rounding, not the GEMMs', would dominate the logits' error)."""
    kinds = {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL",
             "ffn_gate": "IQ4_NL", "ffn_up": "Q8_0", "ffn_down": "IQ4_NL"}
    monkeypatch.setattr(tiny_gguf, "LAYER_TYPES", [kinds])
    # The float32 load converts the file once into the models cache: keep that copy here.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    quantize = gguf.quants.quantize

    def quantize_with_iq4_nl(values, qtype):
        if qtype == gguf.GGMLQuantizationType.IQ4_NL:
            return quantize_iq4_nl(np.asarray(values, np.float32))
        return quantize(values, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", quantize_with_iq4_nl)
    return tiny_gguf.write_tiny_gguf(tmp_path / "iq4.gguf", num_layers=2, hidden_size=64,
                                     intermediate_size=96, embed_type="IQ4_NL", tied=True)


class FakeQuantNumpy(NumpyBackend):
    """The float32 numpy backend with every GEMM's activations quantized as the kernel's q8x2
    (engine_helpers.fake_quantize_rows): the quantized kernel's arithmetic in float64."""

    def linear(self, x, weight, bias=None, *, out_dtype=None):
        y = fake_quantize_rows(x, "q8x2") @ np.asarray(weight, np.float64).T
        if bias is not None:
            y = y + bias
        return y.astype(np.float32)


def test_iq4_nl_file_is_served_kept_quantized(iq4_nl_gguf, rng):
    config, qweights, _ = load_model(str(iq4_nl_gguf.path), quantization="gguf")
    _, fweights, _ = load_model(str(iq4_nl_gguf.path))  # the float32 load: gguf dequantizes
    layer = qweights.layers[0]
    assert isinstance(layer.q_proj, QuantizedMatrix) and layer.q_proj.ggml_type == "IQ4_NL"
    assert isinstance(qweights.embed_tokens, QuantizedMatrix)
    # The loader's blocks (q/k rows unpermuted) hold the float32 load's values exactly.
    for field in ("q_proj", "k_proj", "gate_proj", "up_proj"):
        np.testing.assert_array_equal(getattr(layer, field).dequantize(),
                                      getattr(fweights.layers[0], field))
    backend = CpuGgufBackend(kv_cache_dtype="float32", activations="q8x2")
    tokens = rng.integers(3, config.vocab_size, 23).tolist()
    got, model = prefill_logits(config, qweights, backend, tokens, backend_caches=True)
    # Every matrix stayed quantized: IQ4_NL as Q8_0, gate (IQ4_NL) + up (Q8_0) fused as one,
    # the tied head (the IQ4_NL table) too.
    assert backend.dequantized_types == set()
    for packed in (model.layers[0].qkv, model.layers[0].gate_up, model.layers[1].down,
                   model.lm_head):
        assert isinstance(packed, cpu_gemm.PackedGgufWeight) and packed.ggml_type == "Q8_0"
    ref = prefill_logits(config, fweights, FakeQuantNumpy(), tokens)
    # As test_cpu_gguf's tiny-model check: float32 summation order, the C++ norms / rotary /
    # attention, and the rare activation rounding the other way at a tie of x / dx.
    assert np.max(np.abs(got - ref)) <= 2e-3 * float(ref.std())
