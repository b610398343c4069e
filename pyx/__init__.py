"""Cython hot loops of paged-run: block pool, KV cache manager, scheduler.

These modules are compiled by CMake at install time (`pip install .`). Importing them from a
source checkout that was never built raises an ImportError that says how to build.

How: importing this package appends `_NotBuiltFinder` to `sys.meta_path`. Import machinery asks
it only after every other finder failed to find a module, and it answers for
`pagedrun.pyx.<name>` alone: when `<name>` is one of our Cython modules (its .pyx/.pxd source
is in this package's folder, or the folder holds no compiled module at all: a checkout that was
never built) it raises ImportError with the build command. A plain ImportError, not
ModuleNotFoundError, so that `from pagedrun.pyx import scheduler` raises it too (the import
system silently drops a ModuleNotFoundError for a from-list name). (In a source checkout,
python/pagedrun/__init__.py puts the repository root on `pagedrun.__path__`, so that
`pagedrun.pyx` is this folder.)
"""
from __future__ import annotations

import os
import sys

BUILD_COMMAND = "bash scripts/install.sh"


def _not_built_message(fullname: str, dirs: list[str]) -> str:
    from importlib.machinery import EXTENSION_SUFFIXES

    name = fullname.rpartition(".")[2]
    return (
        f"{fullname} is a Cython module of paged-run that was never built: there is no compiled "
        f"{name}{EXTENSION_SUFFIXES[0]} in {', '.join(dirs)}. The Cython modules are compiled "
        f"at install time: build them with `{BUILD_COMMAND}` from the repository root "
        f"(`{BUILD_COMMAND} --editable` for a development install; it installs into the "
        f"interpreter that `scripts/python` then runs)")


def _is_unbuilt_cython_module(name: str, dirs: list[str]) -> bool:
    from importlib.machinery import EXTENSION_SUFFIXES

    for d in dirs:
        if any(os.path.isfile(os.path.join(d, name + ext)) for ext in (".pyx", ".pxd")):
            return True
    try:
        entries = [e for d in dirs for e in os.listdir(d)]
    except OSError:
        return False
    return not any(e.endswith(tuple(EXTENSION_SUFFIXES)) for e in entries)


class _NotBuiltFinder:
    """The last finder on sys.meta_path: turns "not found" for a Cython module of this
    package into an ImportError that says how to build it."""

    _pagedrun_not_built_finder = True  # found by name, so a reload does not add a second one

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        prefix = __name__ + "."
        if not fullname.startswith(prefix) or "." in fullname[len(prefix):]:
            return None
        dirs = [str(d) for d in (path if path is not None else __path__)]
        if not _is_unbuilt_cython_module(fullname[len(prefix):], dirs):
            return None
        raise ImportError(_not_built_message(fullname, dirs), name=fullname)


if not any(getattr(f, "_pagedrun_not_built_finder", False) for f in sys.meta_path):
    sys.meta_path.append(_NotBuiltFinder)
