"""Registers the test-only helper modules that live next to the tests using them.

pytest runs with --import-mode=importlib, so test folders are not on sys.path and `import
tiny_gguf` would fail. pytest imports this conftest before collecting any test module (also
when a single file is run), so loading each helper here by path, once, under a prefixed name
lets test modules write e.g. `import pagedrun_tests_tiny_gguf as tiny_gguf`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

# sys.modules name -> helper file under tests/. Prefixed so no name can shadow an installed
# package; the helpers import only numpy, pytest, pagedrun and the standard library.
HELPER_MODULES = {
    "pagedrun_tests_tiny_gguf": "foundation/tiny_gguf.py",
    "pagedrun_tests_pyx_fake_worker": "pyx/fake_worker.py",
    "pagedrun_tests_lora_helpers": "lora/lora_helpers.py",
    "pagedrun_tests_sim_schedule": "sim_schedule.py",
}


def _register(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered before exec_module so dataclasses in it can resolve their own module.
    sys.modules[name] = module
    spec.loader.exec_module(module)


for _name, _relpath in HELPER_MODULES.items():
    _register(_name, TESTS_DIR / _relpath)


def pytest_addoption(parser) -> None:
    # tests/engine/conftest.py: which backends the engine tests' `tiny_model` runs on.
    parser.addoption("--engine-backends", default="all", metavar="NAMES",
                     help="comma-separated engine test backends (cpu, cpu-bf16, sim) or 'all'; "
                          "CI's later tiers re-run the engine tests on cpu only")
    # The CPU harness's schedule (cuda/sim/runtime.cpp, "Schedules"): 0 runs blocks and
    # threads in index order; a seed, or "random" (one drawn and printed), shuffles them so a
    # race whose outcome index order fixes shows up. Without the option the kernel and harness
    # tests draw a fresh random schedule per test (tests/sim_schedule.py), the rest index order.
    # runtime/cpu_isa.py: the compiled cpu kernels' "auto" capped at this level for the whole
    # run, every engine a test builds included (CI re-runs the cpu kernel and engine tests with
    # --cpu-isa avx2, so an AVX-512 box runs what an AVX2-only CPU gets).
    parser.addoption("--cpu-isa", default="auto", metavar="LEVEL",
                     help="cap the cpu kernels' instruction set: auto, amx, avx512, avx2, "
                          "portable")
    parser.addoption("--sim-schedule-seed", default="0", metavar="SEED",
                     help="CPU harness block/thread order: 0 (index order), an int, or random")


def pytest_configure(config) -> None:
    isa = config.getoption("--cpu-isa")
    if isa != "auto":
        from pagedrun.runtime import cpu_isa

        cpu_isa.set_ceiling(isa)
        sys.stderr.write(cpu_isa.describe() + "\n")
    value = config.getoption("--sim-schedule-seed")
    seed = int.from_bytes(os.urandom(8), "little") if value == "random" \
        else int(value)
    if seed:
        from pagedrun.runtime.kernels import sim_module

        sim_module.set_schedule_seed(seed)
        # Printed where -q and captured output still show it, so a failure replays.
        sys.stderr.write(f"CPU harness schedule seed {seed} (--sim-schedule-seed {seed})\n")
