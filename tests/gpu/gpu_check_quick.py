"""pytest plugin of `tests/gpu/run_all.sh --quick`: keeps the first collected test of each file.

CI rehearses the whole GPU check on the CPU harness in well under a minute with it: every
pytest step still runs every file (so an import error, a missing fixture or a renamed file
still fails), one test each. Loaded by name (`-p gpu_check_quick`, this folder on PYTHONPATH)
only by run_all.sh; deselected tests are reported as such in pytest's closing line.
"""
from __future__ import annotations


def pytest_collection_modifyitems(session, config, items):
    seen_files: set[str] = set()
    kept, dropped = [], []
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        (dropped if path in seen_files else kept).append(item)
        seen_files.add(path)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
