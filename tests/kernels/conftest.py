"""Fixtures of the kernel tests: fresh random inputs and a fresh random CPU-harness schedule
every run (both seeds printed, so a failure can be replayed), helpers in paged_kernel_inputs.py
(this folder goes on sys.path)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from pagedrun_tests_sim_schedule import sim_schedule  # noqa: F401 (autouse fixture)

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % (2**63))
    print(f"kernel test seed {seed}")
    return np.random.default_rng(seed)
