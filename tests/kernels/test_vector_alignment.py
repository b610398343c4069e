"""Every wrapper whose kernel reads or writes with vector accesses (16-byte loads and cp.async,
8- and 4-byte loads, pair stores) checks the addresses first: a misaligned view -- the same
shape and dtype, starting a few bytes off the boundary -- is refused before anything launches,
or, where an element-wise instantiation exists, routed to it. On a GPU a misaligned vector
access traps; the CPU harness would run it silently (x86 loads any address), so these checks
are the only place the fault can show before a GPU run. The modules here record launches and
never run a kernel: what is tested is the wrapper's decision."""
from __future__ import annotations

import numpy as np
import pytest

from paged_kernel_inputs import BACKEND
from pagedrun.runtime.kernels import attention, cache_ops, fused_ops, gemm, gemm_hopper, moe
from pagedrun.runtime.kernels.gemm_wq import gemm_w4a16, gemm_w8a16
from pagedrun.runtime.kernels.kernel_args import UnsupportedKernelShape

pytestmark = pytest.mark.skipif(BACKEND != "sim", reason="numpy views on the harness's side")

BF16 = np.uint16
BOUNDARY = 64  # bytes: past every alignment a kernel asks for


def aligned(shape, dtype=BF16):
    return shifted(shape, dtype, 0)


def shifted(shape, dtype=BF16, offset=None):
    """A zeroed C-contiguous array `offset` bytes (default: one element) past a 64-byte
    boundary, as a view into a larger buffer is."""
    dtype = np.dtype(dtype)
    offset = dtype.itemsize if offset is None else offset
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 2 * BOUNDARY, np.uint8)
    start = -raw.ctypes.data % BOUNDARY + offset
    view = raw[start:start + nbytes].view(dtype).reshape(shape)
    assert view.ctypes.data % BOUNDARY == offset and view.flags.c_contiguous
    return view


class Launches:
    """A module that records the kernels launched through it and runs none."""

    def __init__(self):
        self.names = []

    def get_function(self, name):
        names = self.names

        class Function:
            max_dynamic_shared_size_bytes = 0

            def __call__(self, *args, **kwargs):
                names.append(name)

        return Function()


def refused(call, name):
    """call(module) must raise UnsupportedKernelShape naming `name`, having launched nothing."""
    module = Launches()
    with pytest.raises(UnsupportedKernelShape, match=rf"^{name} \(address"):
        call(module)
    assert module.names == [], f"launched {module.names} with a misaligned {name}"


# ---- GEMMs ----------------------------------------------------------------------------------
M, N, K = 4, 32, 64


def test_gemm_reads_a_misaligned_operand_element_wise():
    module = Launches()
    gemm.gemm(module, shifted((M, K)), aligned((N, K)))
    assert module.names == ["gemm_bf16_nk_obf16_unaligned"]


def test_gemm_refuses_a_misaligned_output_for_its_pair_stores():
    refused(lambda m: gemm.gemm(m, aligned((M, K)), aligned((N, K)), out=shifted((M, N))),
            "out")
    refused(lambda m: gemm.gemm(m, aligned((M, K), np.float32), aligned((N, K), np.float32),
                                out=shifted((M, N), np.float32)), "out")


@pytest.mark.parametrize("operand", ["a", "b", "out"])
def test_gemm_hopper_refuses_misaligned_operands(operand):
    arrays = {"a": aligned((130, K)), "b": aligned((N, K)), "out": aligned((130, N))}
    arrays[operand] = shifted(arrays[operand].shape)
    refused(lambda m: gemm_hopper.gemm_hopper(m, arrays["a"], arrays["b"], out=arrays["out"]),
            operand)


WQ_GROUP = 32


def _wq_arrays(bits):
    words = 8 if bits == 8 else 4
    return {"x": aligned((M, K)), "qweight": aligned((K // 32, 1, 32, words), np.uint32),
            "scales": aligned((K // WQ_GROUP, 32)), "zeros": aligned((K // WQ_GROUP, 32), np.uint8),
            "out": aligned((M, N))}


@pytest.mark.parametrize("bits, array, offset", [
    (8, "x", 8), (8, "qweight", 4), (8, "scales", 2), (8, "out", 2),
    (4, "x", 2), (4, "qweight", 8), (4, "scales", 4), (4, "zeros", 2), (4, "out", 2)])
def test_weight_only_gemm_refuses_misaligned_arrays(bits, array, offset):
    arrays = _wq_arrays(bits)
    arrays[array] = shifted(arrays[array].shape, arrays[array].dtype, offset)
    a = arrays

    def call(module):
        if bits == 8:
            return gemm_w8a16(module, a["x"], a["qweight"], a["scales"], n=N,
                              group_size=WQ_GROUP, out=a["out"])
        return gemm_w4a16(module, a["x"], a["qweight"], a["scales"], a["zeros"], n=N,
                          group_size=WQ_GROUP, out=a["out"])

    refused(call, array)


@pytest.mark.parametrize("array", ["x", "w_gate_up", "w_down"])
def test_moe_grouped_gemm_refuses_misaligned_operands(array):
    experts, hidden, inter, tokens = 2, 16, 16, 3
    arrays = {"x": aligned((tokens, hidden)), "w_gate_up": aligned((experts, 2 * inter, hidden)),
              "w_down": aligned((experts, hidden, inter))}
    arrays[array] = shifted(arrays[array].shape)
    topk_ids = np.zeros((tokens, 1), np.int32)
    topk_weights = np.ones((tokens, 1), np.float32)
    refused(lambda m: moe.moe_experts(m, arrays["x"], topk_ids, topk_weights,
                                      arrays["w_gate_up"], arrays["w_down"]), array)


# ---- block copies ---------------------------------------------------------------------------
@pytest.mark.parametrize("array", ["dst", "src"])
def test_block_copy_refuses_misaligned_pools(array):
    pools = {"dst": aligned((4, 16, 1, 64)), "src": aligned((4, 16, 1, 64))}
    pools[array] = shifted(pools[array].shape, offset=8)
    pairs = np.array([[0, 1]], np.int32)
    refused(lambda m: cache_ops.move_blocks(m, pools["dst"], pools["src"], pairs), array)


# ---- attention ------------------------------------------------------------------------------
HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 64, 16, 4


def _attention_arrays(cache_dtype=BF16):
    return {"q": aligned((1, HEADS, HEAD_DIM)),
            "k_cache": aligned((NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM), cache_dtype),
            "v_cache": aligned((NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM), cache_dtype),
            "out": aligned((1, HEADS, HEAD_DIM))}


@pytest.mark.parametrize("array, cache_dtype", [
    ("q", BF16), ("k_cache", BF16), ("v_cache", BF16), ("k_cache", np.uint8)])
def test_decode_attention_refuses_misaligned_q_and_caches(array, cache_dtype):
    a = _attention_arrays(cache_dtype)
    a[array] = shifted(a[array].shape, a[array].dtype, offset=8)
    refused(lambda m: attention.paged_decode_attention(
        m, a["q"], a["k_cache"], a["v_cache"], np.zeros((1, 2), np.int32),
        np.array([5], np.int32), 0.125), array)


@pytest.mark.parametrize("array", ["q", "k_cache", "v_cache", "out"])
def test_prefill_attention_refuses_misaligned_arrays(array):
    a = _attention_arrays()
    a[array] = shifted(a[array].shape)
    refused(lambda m: attention.paged_prefill_attention(
        m, a["q"], a["k_cache"], a["v_cache"], np.zeros((1, 2), np.int32),
        np.array([0, 1], np.int32), np.array([5], np.int32), 0.125, out=a["out"]), array)


# ---- fused ops: element-wise instantiations -------------------------------------------------
def test_activation_reads_a_misaligned_input_element_wise():
    for gate_up, out in ((shifted((2, 64)), None), (aligned((2, 64)), shifted((2, 32)))):
        module = Launches()
        fused_ops.silu_and_mul(module, gate_up, out=out)
        assert module.names == ["silu_and_mul_bf16_unaligned"]


def test_embedding_reads_a_misaligned_table_element_wise():
    module = Launches()
    fused_ops.embedding(module, np.array([1, 0], np.int32), shifted((4, 64)))
    assert module.names == ["embedding_bf16_unaligned"]
