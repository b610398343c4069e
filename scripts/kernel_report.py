#!/usr/bin/env python3
"""Static performance report of every cuda/*.cu kernel on H200 (sm_90a): a model, not a
measurement.

For each kernel file it builds one sm_90a cubin (scripts/compile_gates.py's nvcc_cubin, so the
flags and include paths are the gates'), then reads per extern "C" kernel:
  - ptxas -v: registers, spill bytes, static shared memory;
  - cuobjdump -elf: the block size promised by __launch_bounds__ (EIATTR_MAX_THREADS);
  - cuobjdump -sass: the main loop (below) and its instruction mix;
and adds the dynamic shared memory the launch wrapper in runtime/kernels/ asks for (DYNAMIC_SMEM;
"n/a" where the wrapper's amount depends on run-time arguments or no rule names the kernel).

Main loop: the loops are the backward branches of the SASS. Among them it takes the innermost
ones that hold tensor instructions (HMMA/HGMMA...), or else global loads, or else any memory
instruction, and of those the one with most such instructions (then the longest). Its body is
counted statically (a nested loop's instructions once), per SASS iteration: memory, tensor, and
other instructions (NOPs left out). A kernel with no loop is counted whole.

The model (every number in ASSUMPTIONS is printed with the report):
  occupancy     CTAs per SM = min over registers (256-register warp granules of a 64K file),
                shared memory (static + dynamic + 1 KiB reserved per CTA, 128-byte granules,
                228 KiB per SM), threads (2048) and the 32-CTA cap.
  in flight     global bytes loaded by one iteration x threads per CTA x CTAs per SM, as if one
                iteration's loads are outstanding at a time; against Little's law's need of
                HBM bandwidth x latency / SMs.
  roofline      per iteration of one CTA: HBM time (bytes at the SM's share of HBM bandwidth),
                issue time (warp instructions at 4 per clock per SM) and tensor time (FLOPs at
                the SM's share of the dense bf16 peak; mma.sync at a fraction of it). Loops with
                tensor instructions are taken as compute loops (operand reuse is served by L2,
                so the HBM term is left out): estimate = % of dense peak. Others are streaming
                loops (every loaded byte comes from HBM once): estimate = % of HBM peak, capped
                by the in-flight fraction. A tiled SIMT GEMM (gemm_f32_*) reuses its loads, so
                for it the streaming estimate is a floor.

Usage: python scripts/kernel_report.py [cuda/x.cu ...] [--json PATH] [--markdown PATH [--check]]
  --check   compare the markdown with the file at PATH instead of writing it; exit 1 if stale.
The cubins come from compile_gates.nvcc_cubin (sm_90, sm_90a for Hopper-only files), through its
content cache (~/.cache/paged-run/cubins: after the gates, no second nvcc run). The analysis is
cached by content hash (kernel sources + headers, nvcc and cuobjdump versions, this script and
compile_gates.py) in ~/.cache/paged-run/kernel_report. Exit 0 on success, 1 when a
build fails or --check finds a stale file, 2 when nvcc or cuobjdump is missing (0 with
--allow-missing, which prints SKIP).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The builds: sm_90, and sm_90a for a file with Hopper-only instructions (gates.hopper_arch).
ARCH = "sm_90/sm_90a"
NOTE = ("A static model, not a measurement: numbers come from ptxas, cuobjdump and the "
        "assumptions below; no kernel was run.")


def _load_gates():
    spec = importlib.util.spec_from_file_location("compile_gates", REPO / "scripts" /
                                                  "compile_gates.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return sys.modules[spec.name]


gates = _load_gates()

# ---- H200 / sm_90 assumptions (printed with every report) ---------------------------------
ASSUMPTIONS = {
    "gpu": "H200 SXM (sm_90), numbers from public specifications, none measured here",
    "sms": 132,
    "clock_hz": 1.98e9,            # boost clock
    "hbm_bytes_per_s": 4.8e12,     # HBM3e peak
    "dense_bf16_flop_per_s": 989e12,
    "mma_sync_fraction": 0.65,     # HMMA (mma.sync) share of the wgmma peak: assumed, unmeasured
    "hbm_latency_s": 700e-9,       # loaded DRAM latency assumed for Little's law
    "issue_per_clock_per_sm": 4,   # one warp instruction per scheduler per clock, 4 schedulers
    "registers_per_sm": 65536,
    "register_granule_per_warp": 256,
    "smem_per_sm": 228 * 1024,
    "smem_max_per_block": 227 * 1024,
    "smem_reserved_per_block": 1024,
    "smem_granule": 128,
    "threads_per_sm": 2048,
    "ctas_per_sm": 32,
}


def need_in_flight_bytes(a: dict = ASSUMPTIONS) -> float:
    """Little's law: bytes an SM must keep in flight to draw its share of HBM bandwidth."""
    return a["hbm_bytes_per_s"] * a["hbm_latency_s"] / a["sms"]


# ---- dynamic shared memory, from the launch wrappers ---------------------------------------
def _dynamic_smem_rules():
    from pagedrun.runtime.kernels import attention, gemm, gemm_hopper, moe

    zero = "0: launched without shared_mem"
    return [
        (r"paged_attention_decode_merge_", lambda m: 0, zero + " (attention.py)"),
        (r"paged_attention_decode_tc_(\w+)_d(\d+)_g(\d+)$",
         lambda m: attention.decode_tc_smem_bytes(int(m[3]), int(m[2]), m[1]),
         "attention.decode_tc_smem_bytes"),
        (r"paged_attention_decode_(\w+)_d(\d+)_g(\d+)$",
         lambda m: attention.decode_smem_bytes(int(m[3]), int(m[2]), m[1]),
         "attention.decode_smem_bytes"),
        (r"paged_attention_prefill_(\w+)_d(\d+)$",
         lambda m: attention.prefill_smem_bytes(m[1], int(m[2])),
         "attention.prefill_smem_bytes"),
        (r"gemm_skinny_tc_", lambda m: gemm.SKINNY_TC_SMEM_BYTES, "gemm.SKINNY_TC_SMEM_BYTES"),
        (r"gemm_hopper_", lambda m: gemm_hopper.HOPPER_SMEM_BYTES,
         "gemm_hopper.HOPPER_SMEM_BYTES"),
        (r"gemm_skinny_\w+_m(\d+)$", lambda m: int(m[1]) * gemm.SKINNY_SMEM_BYTES_PER_ROW,
         "gemm.SKINNY_SMEM_BYTES_PER_ROW x m_tile"),
        (r"gemm_splitk_reduce_", lambda m: 0, zero + " (gemm.py)"),
        (r"gemm_(f32|f16|bf16)_(nk|kn)_", lambda m: gemm.gemm_smem_bytes(m[1]),
         "gemm.gemm_smem_bytes"),
        (r"gemm_(w[48]a16|wq_splitk_reduce)_", lambda m: 0,
         zero + " (gemm_wq.py; static tiles only)"),
        (r"moe_(gate_up|down)_(f32|f16|bf16)$", lambda m: moe.grouped_gemm_smem_bytes(m[2]),
         "moe.grouped_gemm_smem_bytes"),
        (r"moe_route_", lambda m: None, "n/a: 16 B x num_experts (moe.py, run time)"),
        (r"moe_(count_experts|scatter|unpermute_reduce)", lambda m: 0, zero + " (moe.py)"),
        (r"(rms_norm|fused_add_rms_norm|silu_and_mul|gelu_tanh_and_mul|embedding)_", lambda m: 0,
         zero + " (fused_ops.py)"),
        (r"(rotary_cache_write_|copy_blocks$)", lambda m: 0, zero + " (cache_ops.py)"),
        (r"lora_(shrink|expand)_", lambda m: 0, zero + " (lora.py)"),
        (r"rejection_sample$", lambda m: 0, zero + " (rejection.py)"),
        (r"(process_logits|sample)_f32$", lambda m: 0, zero + " (sampling.py)"),
    ]


def dynamic_smem(kernel: str, rules) -> tuple[int | None, str]:
    for pattern, fn, source in rules:
        if m := re.match(pattern, kernel):
            return fn(m), source
    return None, "n/a: no wrapper rule names this kernel"


# ---- SASS ----------------------------------------------------------------------------------
_FUNCTION = re.compile(r"Function : (\S+)")
# Opcodes may carry lower-case shape suffixes (HGMMA.64x256x16.F32.BF16).
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
# (HFMA2.MMA is not one: an HFMA2, often a register move, issued to the MMA pipe.)
TENSOR_OPS = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "BMMA", "BGMMA", "DMMA")
GLOBAL_LOADS = ("LDG", "LDGSTS", "LD", "UTMALDG", "UBLKCP")
GLOBAL_STORES = ("STG", "ST", "UTMASTG")
MEMORY_OPS = GLOBAL_LOADS + GLOBAL_STORES + ("LDS", "STS", "LDSM", "STSM", "LDL", "STL",
                                             "ATOM", "ATOMG", "ATOMS", "RED", "UTMAPF")


def base_op(opcode: str) -> str:
    return opcode.split(".")[0]


def access_bytes(opcode: str) -> int:
    """Bytes per thread of one load/store: LDG.E.128 -> 16, LDG.E.U16 -> 2, LDG.E -> 4."""
    parts = set(opcode.split(".")[1:])
    for token, nbytes in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if token in parts:
            return nbytes
    return 4


def mma_flops(opcode: str) -> int:
    """FLOPs of one warp's tensor instruction: HMMA.16816 -> 2*16*8*16; HGMMA.64xNx16 is a
    warpgroup's 2*64*N*16, a quarter per warp."""
    parts = opcode.split(".")
    if parts[0] == "HGMMA" or parts[0].endswith("GMMA"):
        m = re.match(r"(\d+)x(\d+)x(\d+)", parts[1]) if len(parts) > 1 else None
        return 2 * int(m[1]) * int(m[2]) * int(m[3]) // 4 if m else 0
    if parts[0] in ("HMMA", "IMMA", "BMMA", "DMMA") and len(parts) > 1:
        shape = parts[1]
        for mn, m_, n_ in (("168", 16, 8), ("88", 8, 8)):
            if shape.startswith(mn) and shape[len(mn):].isdigit():
                return 2 * m_ * n_ * int(shape[len(mn):])
    return 0


def parse_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass -> {kernel: [(address, opcode[ target])...]} (branch targets kept)."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        if m := _FUNCTION.search(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTR.search(line)):
            op = m.group(3)
            if base_op(op) in ("BRA", "JMP") and (t := _TARGET.search(m.group(4))):
                op = f"{op} {t.group(1)}"
            current.append((int(m.group(1), 16), op))
    return out


def _category(instrs, tag) -> int:
    ops = [base_op(op.split()[0]) for _, op in instrs]
    if tag == "tensor":
        return sum(op in TENSOR_OPS for op in ops)
    if tag == "global":
        return sum(op in GLOBAL_LOADS for op in ops)
    return sum(op in MEMORY_OPS for op in ops)


def main_loop(instrs: list[tuple[int, str]]) -> dict:
    """The main loop of one kernel's SASS and its instruction mix (module docstring)."""
    # A branch to itself is the trap after the last EXIT, not a loop.
    loops = sorted({(int(op.split()[1], 16), addr) for addr, op in instrs
                    if " " in op and int(op.split()[1], 16) < addr})
    bodies = {lp: [(a, op) for a, op in instrs if lp[0] <= a <= lp[1]] for lp in loops}
    chosen, tag = None, "none"
    for tag in ("tensor", "global", "memory"):
        cands = [lp for lp in loops if _category(bodies[lp], tag)]
        inner = [lp for lp in cands if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                               for o in cands)]
        if inner:
            chosen = max(inner, key=lambda lp: (_category(bodies[lp], tag), len(bodies[lp]),
                                                -lp[0]))
            break
    if chosen is None and loops:
        chosen, tag = max(loops, key=lambda lp: (len(bodies[lp]), -lp[0])), "longest"
    body = bodies[chosen] if chosen else instrs
    counts = {"memory": 0, "tensor": 0, "other": 0}
    load_bytes = store_bytes = flops = 0
    for _, op in body:
        opcode = op.split()[0]
        base = base_op(opcode)
        if base == "NOP":
            continue
        if base in TENSOR_OPS:
            counts["tensor"] += 1
            flops += mma_flops(opcode)
        elif base in MEMORY_OPS:
            counts["memory"] += 1
            if base in ("LDG", "LDGSTS", "LD"):
                load_bytes += access_bytes(opcode)
            elif base in ("STG", "ST"):
                store_bytes += access_bytes(opcode)
        else:
            counts["other"] += 1
    return {
        "found": chosen is not None,
        "selected_by": tag if chosen else "no loop: whole kernel",
        "sass_range": [f"{chosen[0]:#06x}", f"{chosen[1]:#06x}"] if chosen else None,
        "num_loops": len(loops),
        **counts,
        "uses_tma": any(base_op(op) in ("UTMALDG", "UBLKCP") for _, op in body),
        "uses_mma_sync": any(base_op(op) == "HMMA" for _, op in body),
        "load_bytes_per_thread": load_bytes,
        "store_bytes_per_thread": store_bytes,
        "flops_per_warp": flops,
    }


_NV_INFO = re.compile(r"^\.nv\.info\.(\S+)")


def parse_max_threads(elf_text: str) -> dict[str, int]:
    """cuobjdump -elf -> {kernel: EIATTR_MAX_THREADS product} (__launch_bounds__'s block)."""
    out: dict[str, int] = {}
    current, pending = None, False
    for line in elf_text.splitlines():
        if m := _NV_INFO.match(line):
            current, pending = m.group(1), False
        elif current and "EIATTR_MAX_THREADS" in line:
            pending = True
        elif pending and line.strip().startswith("Value:"):
            dims = [int(v, 16) for v in line.split(":", 1)[1].split()]
            out[current] = math.prod(dims)
            pending = False
    return out


# ---- tools, build and cache ----------------------------------------------------------------
def find_cuobjdump() -> str | None:
    root = gates.toolkit_root()
    cands = [str(root / "bin" / "cuobjdump")] if root else []
    cands.append(shutil.which("cuobjdump") or "")
    for mod in ("nvidia", "triton"):  # the nvidia-cuda-cuobjdump wheel; Triton bundles one
        spec = importlib.util.find_spec(mod)
        for base in (spec.submodule_search_locations or []) if spec else []:
            cands += sorted(glob.glob(os.path.join(base, "*", "bin", "cuobjdump")))
            cands += sorted(glob.glob(os.path.join(base, "backends", "nvidia", "bin",
                                                   "cuobjdump")))
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def tool_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1] if out.strip() else "?"


def cache_key(path: Path, versions: str) -> str:
    from pagedrun.runtime.kernels import prebuilt

    h = hashlib.sha256(prebuilt.source_sha256(path.name, path.parent).encode())
    h.update(versions.encode())
    for own in ("kernel_report.py", "compile_gates.py"):
        h.update((REPO / "scripts" / own).read_bytes())
    return h.hexdigest()[:32]


def analyse_file(path: Path, nvcc: Path, cuobjdump: str, versions: str,
                 cache_dir: Path | None) -> dict:
    """One kernel file -> {"file", "ok", "error", "kernels": {name: static facts}}."""
    cached = cache_dir / f"{path.stem}-{cache_key(path, versions)}.json" if cache_dir else None
    if cached and cached.is_file():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        # sm_90 like the gates (sm_90a for a Hopper-only file: the same SASS elsewhere), so
        # that CI's tier 3 reuses the gates' builds from the cubin cache.
        proc = gates.nvcc_cubin(nvcc, path, gates.hopper_arch(path.read_text()), cubin,
                                None if cache_dir is None else gates.CUBIN_CACHE)
        if proc.returncode != 0:
            return {"file": path.name, "ok": False,
                    "error": "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])}
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        elf = subprocess.run([cuobjdump, "-elf", cubin], capture_output=True, text=True,
                             check=True).stdout
    stats = gates.parse_ptxas(proc.stdout + proc.stderr)
    threads = parse_max_threads(elf)
    code = parse_sass(sass)
    kernels = {}
    for name in sorted(n for n, fs in stats.items() if fs.entry):
        fs = stats[name]
        kernels[name] = {"registers": fs.registers, "spill_store_bytes": fs.spill_stores,
                         "spill_load_bytes": fs.spill_loads, "stack_bytes": fs.stack_frame,
                         "smem_static": fs.static_smem, "block_threads": threads.get(name),
                         "main_loop": main_loop(code.get(name, []))}
    record = {"file": path.name, "ok": True, "error": None, "kernels": kernels}
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(record))
    return record


# ---- the model -----------------------------------------------------------------------------
def occupancy(registers: int, threads: int, smem_bytes: int, a: dict = ASSUMPTIONS) -> dict:
    """CTAs and warps per SM, and which resource limits them."""
    warps = math.ceil(threads / 32)
    granule = a["register_granule_per_warp"]
    regs_per_warp = math.ceil(max(registers, 1) * 32 / granule) * granule
    per_cta_smem = smem_bytes + a["smem_reserved_per_block"]
    per_cta_smem = math.ceil(per_cta_smem / a["smem_granule"]) * a["smem_granule"]
    limits = {
        "registers": (a["registers_per_sm"] // regs_per_warp) // warps,
        "smem": a["smem_per_sm"] // per_cta_smem
        if smem_bytes <= a["smem_max_per_block"] else 0,
        "threads": a["threads_per_sm"] // (warps * 32),
        "cta_cap": a["ctas_per_sm"],
    }
    ctas = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], list(limits).index(k)))
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "limiter": limiter,
            "occupancy": round(ctas * warps * 32 / a["threads_per_sm"], 3)}


# Kernels whose tensor-instruction loop streams every weight (or K/V) byte once from HBM
# (decode-sized M: no reuse through shared memory or L2 to speak of), so HBM, not the tensor
# pipe, is their roofline: the skinny GEMM's tensor-core kernels, the weight-only GEMMs' 16-row
# tiles and the tensor-core decode attention.
STREAMING_TENSOR = re.compile(
    r"gemm_skinny_tc_|gemm_w[48]a16_\w+_m(8|16)$|paged_attention_decode_tc_")


def roofline(loop: dict, threads: int, ctas_per_sm: int, a: dict = ASSUMPTIONS,
             streaming: bool = False) -> dict:
    """Time of one CTA iteration under each limit; which one binds; the estimate. A loop with
    tensor instructions is a compute loop (% of the dense bf16 peak) unless `streaming`
    (STREAMING_TENSOR): then a streaming loop whose tensor time is one more limit."""
    warps = math.ceil(threads / 32)
    per_sm_bw = a["hbm_bytes_per_s"] / a["sms"]
    load_b = loop["load_bytes_per_thread"] * threads
    move_b = (loop["load_bytes_per_thread"] + loop["store_bytes_per_thread"]) * threads
    instrs = (loop["memory"] + loop["tensor"] + loop["other"]) * warps
    t_issue = instrs / (a["issue_per_clock_per_sm"] * a["clock_hz"])
    flops = loop["flops_per_warp"] * warps
    tensor_rate = a["dense_bf16_flop_per_s"] / a["sms"]
    if loop["uses_mma_sync"]:
        tensor_rate *= a["mma_sync_fraction"]
    t_tensor = flops / tensor_rate
    in_flight = load_b * ctas_per_sm
    if loop["tensor"] and not streaming:
        t_peak = flops / (a["dense_bf16_flop_per_s"] / a["sms"])
        slowest = max(t_tensor, t_issue)
        return {"kind": "compute", "bound": "tensor" if t_tensor >= t_issue else "issue",
                "estimate_pct": round(100 * t_peak / slowest, 1) if slowest else None,
                "tensor_time_s": t_tensor, "issue_time_s": t_issue,
                "of": "dense bf16 peak", "bytes_in_flight_per_sm": in_flight}
    t_mem = move_b / per_sm_bw
    if not move_b or not ctas_per_sm:
        return {"kind": "streaming", "bound": "issue" if instrs else "n/a",
                "estimate_pct": None, "of": "HBM peak",
                "bytes_in_flight_per_sm": in_flight if move_b else None}
    issue_frac = t_mem / max(t_mem, t_issue)
    tensor_frac = t_mem / max(t_mem, t_tensor)
    latency_frac = min(1.0, in_flight / need_in_flight_bytes(a)) if load_b else 1.0
    limits = {"latency": latency_frac, "issue": issue_frac, "tensor": tensor_frac}
    bound = min(limits, key=limits.get)
    if limits[bound] >= 1.0:
        bound = "bandwidth"
    return {"kind": "streaming", "bound": bound,
            "estimate_pct": round(100 * min(limits.values()), 1), "of": "HBM peak",
            "issue_limit_pct": round(100 * issue_frac, 1),
            "latency_limit_pct": round(100 * latency_frac, 1), "bytes_in_flight_per_sm": in_flight}


def kernel_rows(records: list[dict]) -> list[dict]:
    rules = _dynamic_smem_rules()
    rows = []
    for rec in records:
        for name, k in (rec.get("kernels") or {}).items():
            dyn, dyn_src = dynamic_smem(name, rules)
            row = {"file": rec["file"], "kernel": name, "arch": ARCH, **k,
                   "smem_dynamic": dyn, "smem_dynamic_source": dyn_src}
            threads = k["block_threads"]
            if threads and k["registers"]:
                row["occupancy"] = occupancy(k["registers"], threads,
                                             k["smem_static"] + (dyn or 0))
                row["model"] = roofline(k["main_loop"], threads, row["occupancy"]["ctas_per_sm"],
                                        streaming=bool(STREAMING_TENSOR.match(name)))
            else:
                row["occupancy"] = row["model"] = None
            rows.append(row)
    return rows


# ---- output --------------------------------------------------------------------------------
COLUMNS = ("kernel", "thr", "regs", "spill", "smem s+d", "CTA/SM", "warps", "limit",
           "loop mem/tc/oth", "ld B/it", "fly KiB/SM", "bound", "est")


def _cells(row: dict) -> list[str]:
    occ, model, loop = row["occupancy"], row["model"], row["main_loop"]
    dyn = "n/a" if row["smem_dynamic"] is None else str(row["smem_dynamic"])
    mix = f"{loop['memory']}/{loop['tensor']}/{loop['other']}" + ("" if loop["found"] else "*")
    thr = row["block_threads"]
    est = "-"
    if model and model["estimate_pct"] is not None:
        est = f"{model['estimate_pct']:.0f}% " + ("HBM" if model["of"] == "HBM peak" else "TC")
    fly = model["bytes_in_flight_per_sm"] if model else None
    return [row["kernel"], str(thr or "n/a"), str(row["registers"]),
            f"{row['spill_store_bytes']}/{row['spill_load_bytes']}",
            f"{row['smem_static']}+{dyn}",
            str(occ["ctas_per_sm"]) if occ else "n/a", str(occ["warps_per_sm"]) if occ else "n/a",
            occ["limiter"] if occ else "n/a", mix,
            str(loop["load_bytes_per_thread"] * thr) if thr else "n/a",
            f"{fly / 1024:.1f}" if fly is not None else "n/a",
            model["bound"] if model else "n/a", est]


def assumption_lines() -> list[str]:
    a = ASSUMPTIONS
    return [
        f"GPU: {a['gpu']}; {a['sms']} SMs at {a['clock_hz'] / 1e9:.2f} GHz; HBM "
        f"{a['hbm_bytes_per_s'] / 1e12:.1f} TB/s; dense bf16 "
        f"{a['dense_bf16_flop_per_s'] / 1e12:.0f} TFLOP/s; mma.sync (HMMA) at "
        f"{a['mma_sync_fraction']:.0%} of it (assumed).",
        f"Per SM: {a['registers_per_sm']} registers ({a['register_granule_per_warp']}-register "
        f"warp granules), {a['smem_per_sm'] // 1024} KiB shared memory ("
        f"{a['smem_max_per_block'] // 1024} KiB max per block, {a['smem_reserved_per_block']} B "
        f"reserved per CTA, {a['smem_granule']} B granules), {a['threads_per_sm']} threads, "
        f"{a['ctas_per_sm']} CTAs; issue {a['issue_per_clock_per_sm']} warp instructions/clock.",
        f"Little's law: {a['hbm_latency_s'] * 1e9:.0f} ns HBM latency (assumed) x HBM bandwidth "
        f"/ SMs = {need_in_flight_bytes() / 1024:.1f} KiB in flight per SM to stream HBM.",
        "Every thread of the CTA runs the loop body with all its loads enabled; one iteration's "
        "loads are in flight at a time (a cp.async pipeline of S stages keeps about S x that; "
        "TMA bytes are not visible in SASS).",
        "Streaming loops: every loaded or stored byte moves to/from HBM once (a floor for tiled "
        "kernels that reuse loads through shared memory, e.g. gemm_f32_*). Compute loops "
        "(tensor instructions): HBM left out, estimate = % of the dense bf16 peak; except the "
        "decode-sized tensor kernels that stream their weights or K/V once (gemm_skinny_tc_*, "
        "gemm_w4a16/w8a16_*_m8 and _m16, paged_attention_decode_tc_*): streaming "
        "loops, the tensor pipe one more limit.",
    ]


COLUMN_HELP = [
    ("thr", "block size from `__launch_bounds__` (`EIATTR_MAX_THREADS` in the cubin)"),
    ("regs, spill", "ptxas -v registers per thread; spill store/load bytes"),
    ("smem s+d", "static shared bytes (ptxas) + dynamic bytes from the launch wrapper "
                 "(n/a: depends on run-time arguments, taken as 0 for occupancy)"),
    ("CTA/SM, warps, limit", "resident CTAs and warps per SM, and the resource that limits them"),
    ("loop mem/tc/oth", "static SASS instructions in one iteration of the main loop: memory "
                        "(LDG/LDGSTS/LDS/STS/STG/LDSM/TMA...), tensor (HMMA/HGMMA), other; "
                        "* = no loop: the whole kernel, cold paths included"),
    ("ld B/it", "global bytes loaded per main-loop iteration by one CTA"),
    ("fly KiB/SM", "ld B/it x CTAs per SM: bytes in flight per SM (KiB), against Little's "
                   "law's need"),
    ("bound, est", "the binding limit (bandwidth, latency, issue, tensor) and the modelled "
                   "share of HBM peak (HBM) or of the dense bf16 peak (TC)"),
]


def text_table(rows: list[dict]) -> str:
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines, current = [], None
    for row, cells in zip([None] + rows, table):
        if row is not None and row["file"] != current:
            current = row["file"]
            lines.append(f"-- {current}")
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    return "\n".join(lines)


def markdown(rows: list[dict], versions: str, failures: list[dict]) -> str:
    out = [f"# Kernel static performance report (H200, {ARCH})", "",
           f"**{NOTE}** Generated by `scripts/kernel_report.py` (CI checks it is current: "
           "rerun `scripts/python scripts/kernel_report.py --markdown docs/kernel_report.md` "
           f"after changing a kernel). Toolchain: {versions}.", "", "## Assumptions", ""]
    out += [f"- {line}" for line in assumption_lines()]
    out += ["", "## Columns", ""] + [f"- **{c}**: {h}" for c, h in COLUMN_HELP]
    out += ["", "Main loop: the innermost backward-branch loop of the SASS holding tensor "
                "instructions, else global loads, else any memory instruction (the one with "
                "most of them); nested loops are counted once.", ""]
    for f in failures:
        out += [f"**{f['file']}: build failed**", ""]
    current = None
    for row in rows:
        if row["file"] != current:
            current = row["file"]
            out += ["", f"### cuda/{current}", "",
                    "| " + " | ".join(COLUMNS) + " |",
                    "|" + "|".join("---" if i == 0 else "--:" for i in range(len(COLUMNS))) + "|"]
        out.append("| " + " | ".join(_cells(row)) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--json", type=Path, help="write the full report as JSON here")
    ap.add_argument("--markdown", type=Path, help="write (or with --check, compare) markdown")
    ap.add_argument("--check", action="store_true",
                    help="fail if the --markdown file differs from the fresh report")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path.home() / ".cache" / "paged-run" / "kernel_report")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--allow-missing", action="store_true",
                    help="exit 0 with SKIP when nvcc or cuobjdump is missing")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    if args.check and not args.markdown:
        ap.error("--check needs --markdown PATH")
    start = time.monotonic()
    root, cuobjdump = gates.toolkit_root(), find_cuobjdump()
    if root is None or cuobjdump is None:
        what = "nvcc (set CUDA_HOME)" if root is None else \
            "cuobjdump (pip install nvidia-cuda-cuobjdump)"
        print(f"{'SKIP' if args.allow_missing else 'FAIL'} kernel report: {what} not found")
        return 0 if args.allow_missing else 2
    nvcc = root / "bin" / "nvcc"
    # The markdown names nvcc only: the counts follow the compiler, not the disassembler's
    # version, so --check passes with any cuobjdump.
    versions = f"nvcc {tool_version(str(nvcc))}, cuobjdump {tool_version(cuobjdump)}"
    compiler = versions.split(",")[0]
    files = [p.resolve() for p in args.files] or sorted((REPO / "cuda").glob("*.cu"))
    cache_dir = None if args.no_cache else args.cache_dir
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        records = list(pool.map(lambda f: analyse_file(f, nvcc, cuobjdump, versions, cache_dir),
                                files))
    failures = [r for r in records if not r["ok"]]
    rows = kernel_rows(records)
    print(f"Kernel report, {ARCH} -- {NOTE}")
    for line in assumption_lines():
        print(f"  assumption: {line}")
    print(text_table(rows))
    for f in failures:
        print(f"FAIL build {f['file']}:\n{f['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            {"note": NOTE, "arch": ARCH, "toolchain": versions, "assumptions": ASSUMPTIONS,
             "need_in_flight_bytes_per_sm": need_in_flight_bytes(), "kernels": rows,
             "failures": failures}, indent=1) + "\n")
    status = 1 if failures else 0
    if args.markdown:
        text = markdown(rows, compiler, failures)
        if args.check:
            old = args.markdown.read_text() if args.markdown.is_file() else ""
            if old != text:
                diff = difflib.unified_diff(old.splitlines(), text.splitlines(), "committed",
                                            "fresh", lineterm="", n=0)
                print(f"FAIL {args.markdown} is stale; regenerate it with "
                      f"scripts/kernel_report.py --markdown {args.markdown}")
                print("\n".join(list(diff)[:40]))
                status = 1
            else:
                print(f"{args.markdown} is current")
        else:
            args.markdown.write_text(text)
    print(f"kernel report: {len(rows)} kernels in {len(records)} files, "
          f"{time.monotonic() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
