"""Loads tests/pyx/fake_worker.py once for the scheduler test modules.

pytest runs with --import-mode=importlib, so this folder is not on sys.path and `import
fake_worker` would fail. pytest imports this conftest before collecting any test module below it
(also when a single file is run), so registering the helper in sys.modules here lets each test
module write `from pagedrun_tests_pyx_fake_worker import FakeWorker` -- one load, one class.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The sys.modules name of fake_worker.py; prefixed so it cannot shadow an installed package.
FAKE_WORKER_MODULE = "pagedrun_tests_pyx_fake_worker"


def _register_fake_worker() -> None:
    if FAKE_WORKER_MODULE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        FAKE_WORKER_MODULE, Path(__file__).with_name("fake_worker.py"))
    module = importlib.util.module_from_spec(spec)
    # Registered before exec_module so dataclasses in it can resolve their own module.
    sys.modules[FAKE_WORKER_MODULE] = module
    spec.loader.exec_module(module)


_register_fake_worker()
