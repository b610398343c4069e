"""The `sim_schedule` fixture that tests/kernels and tests/sim import into their conftests:
each test runs the CPU harness under a freshly drawn random schedule (cuda/sim/runtime.cpp,
"Schedules"), so a race that index order hides fails on the CPU rather than on a GPU."""
from __future__ import annotations

import pytest

from pagedrun.runtime.kernels.sim_module import Schedule, current_schedule, set_schedule


def _test_schedule(config) -> Schedule:
    """--sim-schedule-seed N (tests/conftest.py) pins every test to N (0: index order);
    without it, or with "random", each test draws a fresh seed."""
    args = config.invocation_params.args
    if any(a == "--sim-schedule-seed" or a.startswith("--sim-schedule-seed=") for a in args):
        value = config.getoption("--sim-schedule-seed")
        if value != "random":
            return Schedule.from_seed(int(value))
    return Schedule.random()


@pytest.fixture(autouse=True)
def sim_schedule(request) -> Schedule:
    """One random schedule per test (one draw keeps CI at one run per test); the seed is
    printed, and shown with a failure, for a replay. A test that needs index order calls
    set_schedule(Schedule.INDEX) itself."""
    before = current_schedule()
    schedule = _test_schedule(request.config)
    set_schedule(schedule)
    if schedule.kind == "random":
        print(f"CPU harness {schedule} (replay: --sim-schedule-seed {schedule.seed})")
    yield schedule
    set_schedule(before)
