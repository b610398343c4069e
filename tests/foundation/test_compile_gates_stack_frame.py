"""scripts/compile_gates.py refuses a stack frame, not only spills: on canned `ptxas -v` output,
a kernel with a frame but no spill bytes (a run-time-indexed local array), and a non-inlined
helper with an ABI frame, each fail the gate; frame-free functions pass. No toolkit needed."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gates():
    if "compile_gates" not in sys.modules:
        spec = importlib.util.spec_from_file_location("compile_gates",
                                                      REPO / "scripts" / "compile_gates.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules["compile_gates"]


PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'indexed_local' for 'sm_90'
ptxas info    : Function properties for indexed_local
    128 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 128 bytes cumulative stack size
ptxas info    : Function properties for _Z6helperPf
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'clean' for 'sm_90'
ptxas info    : Function properties for clean
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]
"""


def test_a_stack_frame_without_spills_fails_the_gate():
    gates = _gates()
    stats = gates.parse_ptxas(PTXAS)
    assert stats["indexed_local"].stack_frame == 128 and stats["indexed_local"].spill_stores == 0
    assert stats["_Z6helperPf"].stack_frame == 16 and not stats["_Z6helperPf"].entry
    problems = gates.check_stats(stats, budget=64)
    assert problems == [
        "indexed_local: 128 bytes stack frame (local memory; the gate requires 0)",
        "_Z6helperPf: 16 bytes stack frame (local memory; the gate requires 0)"]


def test_frame_free_functions_pass():
    gates = _gates()
    clean = PTXAS[PTXAS.index("ptxas info    : Compiling entry function 'clean'"):]
    assert gates.check_stats(gates.parse_ptxas(clean), budget=64) == []
