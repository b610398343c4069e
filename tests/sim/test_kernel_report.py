"""scripts/kernel_report.py: its SASS loop finder, occupancy and roofline model on hand-made
inputs whose answers are worked out here, and one real report (cuda/block_copy.cu, one small
kernel) checked for structure and sane values. The real report skips when nvcc or cuobjdump
is absent, and under a sanitizer (nvcc would inherit the preloaded runtime)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_report():
    spec = importlib.util.spec_from_file_location("kernel_report",
                                                  REPO / "scripts" / "kernel_report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _load_report()

SASS = """
        Function : k_loops
        /*0000*/                   MOV R1, c[0x0][0x28] ;            /* 0x000fe40000000f00 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;      /* 0x000ea8000c1e1900 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;  /* 0x000ea8000c1e1d00 */
        /*0030*/                   LDS R8, [R0] ;                    /* 0x000e280000000800 */
        /*0040*/               @P0 BRA 0x30 ;                        /* 0xfffffffc00000947 */
        /*0050*/                   HMMA.16816.F32.BF16 R8, R4, R2, R8 ; /* 0x000 */
        /*0060*/                   LDG.E.U16 R3, desc[UR4][R6.64] ;  /* 0x000 */
        /*0070*/                   NOP ;                             /* 0x000 */
        /*0080*/              @!P1 BRA 0x20 ;                        /* 0x000 */
        /*0090*/                   EXIT ;                            /* 0x000 */
        /*00a0*/                   BRA 0xa0;                         /* 0x000 */
        Function : k_straight
        /*0000*/                   LDG.E.64 R2, desc[UR4][R4.64] ;   /* 0x000 */
        /*0010*/                   STG.E R4, desc[UR4][R2.64], R0 ;  /* 0x000 */
        /*0020*/                   EXIT ;                            /* 0x000 */
        /*0030*/                   BRA 0x30;                         /* 0x000 */
"""


def test_main_loop_prefers_the_loop_with_tensor_instructions():
    code = report.parse_sass(SASS)
    loop = report.main_loop(code["k_loops"])
    # Two loops: [0x30, 0x40] (LDS only) and [0x20, 0x80]; the self-branch at 0xa0 is no loop.
    assert loop["num_loops"] == 2 and loop["found"]
    assert loop["sass_range"] == ["0x0020", "0x0080"] and loop["selected_by"] == "tensor"
    # Body 0x20..0x80: LDG.128, LDS, LDG.U16 | HMMA | BRA, BRA (the NOP is not counted).
    assert (loop["memory"], loop["tensor"], loop["other"]) == (3, 1, 2)
    assert loop["load_bytes_per_thread"] == 16 + 2
    assert loop["flops_per_warp"] == 2 * 16 * 8 * 16 and loop["uses_mma_sync"]


def test_main_loop_without_tensor_takes_the_global_load_loop():
    text = SASS.replace("HMMA.16816.F32.BF16 R8, R4, R2, R8", "FFMA R8, R4, R2, R8")
    loop = report.main_loop(report.parse_sass(text)["k_loops"])
    assert loop["selected_by"] == "global" and loop["sass_range"] == ["0x0020", "0x0080"]
    assert (loop["memory"], loop["tensor"], loop["other"]) == (3, 0, 3)


def test_straight_line_kernel_is_counted_whole():
    loop = report.main_loop(report.parse_sass(SASS)["k_straight"])
    assert not loop["found"] and loop["num_loops"] == 0
    assert (loop["memory"], loop["tensor"], loop["other"]) == (2, 0, 2)
    assert loop["load_bytes_per_thread"] == 8 and loop["store_bytes_per_thread"] == 4


def test_access_bytes_and_mma_flops():
    assert [report.access_bytes(op) for op in ("LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E.U16",
                                               "LDG.E.U8", "LDG.E", "LDGSTS.E.BYPASS.128")] \
        == [16, 8, 2, 1, 4, 16]
    assert report.mma_flops("HMMA.1688.F32") == 2 * 16 * 8 * 8
    assert report.mma_flops("HGMMA.64x128x16.F32.BF16") == 2 * 64 * 128 * 16 // 4
    assert report.mma_flops("HFMA2.MMA") == 0


def test_wgmma_opcode_keeps_its_shape():
    """HGMMA's shape is lower-case inside the opcode; cut at the 'x', the FLOPs were 0."""
    sass = """
        Function : k_wgmma
        /*0ee0*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12], R24 ; /* 0x0 */
        /*0ef0*/                   EXIT ;                            /* 0x000 */
"""
    (op,) = [op for _, op in report.parse_sass(sass)["k_wgmma"] if op.startswith("HG")]
    assert op == "HGMMA.64x256x16.F32.BF16"
    assert report.mma_flops(op) == 2 * 64 * 256 * 16 // 4


def test_parse_max_threads():
    elf = """.nv.info.k_a
	Attribute:	EIATTR_MAX_THREADS
	Format:	EIFMT_SVAL
	Value:	0x80 0x1 0x1
.nv.info.k_b
	Attribute:	EIATTR_CBANK_PARAM_SIZE
	Value:	0x34
	Attribute:	EIATTR_MAX_THREADS
	Value:	0x20 0x2 0x1
"""
    assert report.parse_max_threads(elf) == {"k_a": 128, "k_b": 64}


@pytest.mark.parametrize("regs,threads,smem,ctas,warps,limiter", [
    # 254 regs -> 8192 per warp -> 8 warps -> 2 CTAs of 4 warps; smem 34,048 B -> 6.
    (254, 128, 33024, 2, 8, "registers"),
    # 16 regs, one warp: registers allow 128 warps, threads 64 CTAs, the cap 32.
    (16, 32, 0, 32, 32, "cta_cap"),
    # 100 KiB + 1 KiB reserved per CTA: two fit in 228 KiB.
    (32, 128, 100 * 1024, 2, 8, "smem"),
    (32, 128, 228 * 1024, 0, 0, "smem"),   # over the 227 KiB per block: does not launch
])
def test_occupancy(regs, threads, smem, ctas, warps, limiter):
    occ = report.occupancy(regs, threads, smem)
    assert (occ["ctas_per_sm"], occ["warps_per_sm"], occ["limiter"]) == (ctas, warps, limiter)


def test_roofline_streaming_latency_and_bandwidth():
    loop = {"memory": 2, "tensor": 0, "other": 8, "load_bytes_per_thread": 16,
            "store_bytes_per_thread": 0, "flops_per_warp": 0, "uses_mma_sync": False}
    need = 4.8e12 * 700e-9 / 132                      # 25,454.5 bytes per SM
    low = report.roofline(loop, threads=128, ctas_per_sm=2)
    assert low["bound"] == "latency" and low["bytes_in_flight_per_sm"] == 16 * 128 * 2
    assert low["estimate_pct"] == pytest.approx(100 * 4096 / need, abs=0.1)
    high = report.roofline(loop, threads=128, ctas_per_sm=16)   # 32 KiB in flight
    assert high["bound"] == "bandwidth" and high["estimate_pct"] == 100.0
    # 500 instructions per 16 B: issue time 500*4/(4*1.98e9) vs 2048 B at 4.8e12/132 B/s.
    slow = report.roofline({**loop, "other": 498}, threads=128, ctas_per_sm=16)
    t_mem, t_issue = 2048 / (4.8e12 / 132), 500 * 4 / (4 * 1.98e9)
    assert slow["bound"] == "issue"
    assert slow["estimate_pct"] == pytest.approx(100 * t_mem / t_issue, abs=0.1)


def test_roofline_compute_loop_caps_mma_sync():
    loop = {"memory": 4, "tensor": 32, "other": 20, "load_bytes_per_thread": 64,
            "store_bytes_per_thread": 0, "flops_per_warp": 32 * 4096, "uses_mma_sync": True}
    model = report.roofline(loop, threads=256, ctas_per_sm=2)
    assert model["kind"] == "compute" and model["bound"] == "tensor"
    assert model["estimate_pct"] == pytest.approx(100 * report.ASSUMPTIONS["mma_sync_fraction"])


def test_roofline_streaming_tensor_loop_is_held_to_hbm():
    """A decode-sized tensor loop (weights streamed once) is modelled against HBM: with
    enough bytes in flight and few instructions it is bandwidth-bound, and when its tensor
    time exceeds its memory time the tensor pipe binds, as a share of HBM."""
    a = report.ASSUMPTIONS
    threads, ctas = 128, 4
    load = int(report.need_in_flight_bytes() / ctas / threads) + 16
    t_mem = load * threads / (a["hbm_bytes_per_s"] / a["sms"])
    tensor_rate = a["dense_bf16_flop_per_s"] / a["sms"] * a["mma_sync_fraction"]
    loop = {"memory": 8, "tensor": 8, "other": 8, "load_bytes_per_thread": load,
            "store_bytes_per_thread": 0, "uses_mma_sync": True,
            "flops_per_warp": int(0.5 * t_mem * tensor_rate / (threads // 32))}
    assert report.roofline(loop, threads, ctas)["kind"] == "compute"
    model = report.roofline(loop, threads, ctas, streaming=True)
    assert model["kind"] == "streaming" and model["bound"] == "bandwidth"
    assert model["estimate_pct"] == 100.0
    loop["flops_per_warp"] *= 4  # tensor time = 2x the memory time
    model = report.roofline(loop, threads, ctas, streaming=True)
    assert model["bound"] == "tensor" and model["estimate_pct"] == pytest.approx(50, abs=0.5)
    assert report.STREAMING_TENSOR.match("gemm_skinny_tc_bf16_obf16")
    assert report.STREAMING_TENSOR.match("gemm_w4a16_f16_m16")
    assert report.STREAMING_TENSOR.match("gemm_w4a16_bf16_m8")
    assert report.STREAMING_TENSOR.match("paged_attention_decode_tc_bf16_kv_fp8_d128_g8")
    assert not report.STREAMING_TENSOR.match("gemm_w4a16_f16_m64")
    assert not report.STREAMING_TENSOR.match("gemm_bf16_nk_obf16")


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    from pagedrun.runtime.kernels.sim_module import sanitizer_mode

    if sanitizer_mode() != "plain":
        pytest.skip("nvcc would run under the preloaded sanitizer; the plain job covers it")
    if report.gates.toolkit_root() is None or report.find_cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump)")
    tmp = tmp_path_factory.mktemp("kernel_report")
    args = [str(REPO / "cuda" / "block_copy.cu"), "--json", str(tmp / "r.json"),
            "--markdown", str(tmp / "r.md"), "--cache-dir", str(tmp / "cache")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = report.main(args)
    return rc, out.getvalue(), json.loads((tmp / "r.json").read_text()), tmp, args


def test_real_report_structure_and_values(real_report):
    from pagedrun.runtime.kernels.cache_ops import BLOCK_COPY_THREADS

    rc, text, data, _, _ = real_report
    assert rc == 0 and "not a measurement" in text and "not a measurement" in data["note"]
    assert data["arch"] == "sm_90/sm_90a" and data["failures"] == []
    assert set(data["assumptions"]) >= {"sms", "hbm_bytes_per_s", "dense_bf16_flop_per_s"}
    (row,) = data["kernels"]
    assert row["kernel"] == "copy_blocks" and row["file"] == "block_copy.cu"
    assert 0 < row["registers"] <= 255 and row["spill_store_bytes"] == 0
    assert row["block_threads"] == BLOCK_COPY_THREADS and row["smem_dynamic"] == 0
    occ = row["occupancy"]
    assert 1 <= occ["ctas_per_sm"] <= 32 and occ["warps_per_sm"] == occ["ctas_per_sm"] * 4
    assert 0 < occ["occupancy"] <= 1
    loop = row["main_loop"]
    assert loop["found"] and all(loop[k] >= 0 for k in ("memory", "tensor", "other"))
    # It copies 16-byte vectors: the loop loads a whole number of them and computes nothing.
    assert loop["load_bytes_per_thread"] > 0 and loop["load_bytes_per_thread"] % 16 == 0
    assert loop["tensor"] == 0 and row["model"]["kind"] == "streaming"
    assert 0 < row["model"]["estimate_pct"] <= 100


def test_real_report_check_mode(real_report):
    _, _, data, tmp, args = real_report
    md = tmp / "r.md"
    assert "not a measurement" in md.read_text() and "| copy_blocks |" in md.read_text()
    with contextlib.redirect_stdout(io.StringIO()):
        assert report.main(args + ["--check"]) == 0          # from the cache: identical
        md.write_text(md.read_text().replace("| copy_blocks |", "| copy_blockz |"))
        assert report.main(args + ["--check"]) == 1
