"""Shared fixtures for the harness tests: modules are built once per session (and cached on
disk by content hash), since g++ time dominates this suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedrun.runtime.kernels.sim_module import CUDA_DIR, SimModule
from pagedrun_tests_sim_schedule import sim_schedule  # noqa: F401 (autouse fixture)

TEST_KERNELS = Path(__file__).resolve().parent / "kernels"


def build(source_name: str, options=()) -> SimModule:
    return SimModule(f'#include "{source_name}"\n', options=options,
                     include_dirs=(CUDA_DIR, TEST_KERNELS))


@pytest.fixture(scope="session")
def build_test_module():
    """build(source_name, options=()) -> SimModule over cuda/ and tests/sim/kernels/."""
    return build


@pytest.fixture(scope="session")
def planted() -> SimModule:
    return build("planted_bugs.cu")


@pytest.fixture(scope="session")
def smoke() -> SimModule:
    return build("smoke.cu")


@pytest.fixture(scope="session")
def twins() -> SimModule:
    return build("twin_probes.cu")


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    import numpy as np

    seed = int(np.random.SeedSequence().entropy % (2**63))
    print(f"sim test seed {seed}")
    return np.random.default_rng(seed)
