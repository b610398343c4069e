"""pyx/__init__.py's promise: importing a Cython module of paged-run that was never built raises
an ImportError that names the build command, instead of "No module named 'pagedrun.pyx'".

Each case copies the Python sources (no compiled modules) into a temporary tree and imports
from it in a fresh interpreter run with -I -S: no site-packages, so neither the installed
paged-run nor an editable install's finder can answer instead of the copied tree.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_COMMAND = "bash scripts/install.sh"
SOURCES = ("*.py", "*.pyx", "*.pxd", "*.h")


def copy_sources(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for pattern in SOURCES:
        for f in src.glob(pattern):
            shutil.copy2(f, dst / f.name)


def source_checkout(tmp_path: Path) -> Path:
    """The repository's layout: python/pagedrun/, pyx/ beside it; returns the sys.path entry."""
    copy_sources(REPO / "python" / "pagedrun", tmp_path / "python" / "pagedrun")
    copy_sources(REPO / "pyx", tmp_path / "pyx")
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "python"


def installed_layout(tmp_path: Path) -> Path:
    """The wheel's layout (pagedrun/pyx/ holds __init__.py and the .pxd files) minus the
    compiled modules; returns the sys.path entry."""
    copy_sources(REPO / "python" / "pagedrun", tmp_path / "pagedrun")
    (tmp_path / "pagedrun" / "pyx").mkdir()
    for f in [REPO / "pyx" / "__init__.py", *(REPO / "pyx").glob("*.pxd")]:
        shutil.copy2(f, tmp_path / "pagedrun" / "pyx" / f.name)
    return tmp_path


def run_isolated(path_entry: Path, code: str) -> subprocess.CompletedProcess:
    prog = f"import sys; sys.path.insert(0, {str(path_entry)!r})\n{code}"
    return subprocess.run([sys.executable, "-I", "-S", "-c", prog], capture_output=True,
                          text=True, timeout=60)


def assert_build_error(proc: subprocess.CompletedProcess, module: str) -> None:
    assert proc.returncode != 0, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), proc.stderr
    assert f"{module} is a Cython module of paged-run that was never built" in last, last
    assert f"`{BUILD_COMMAND}`" in last, last


@pytest.mark.parametrize("statement, module", [
    ("import pagedrun.pyx.scheduler", "pagedrun.pyx.scheduler"),
    ("from pagedrun.pyx import cpu_gemm", "pagedrun.pyx.cpu_gemm"),
    ("from pagedrun.pyx.block_pool import BlockPool", "pagedrun.pyx.block_pool"),
])
def test_source_checkout_never_built(tmp_path, statement, module):
    assert_build_error(run_isolated(source_checkout(tmp_path), statement), module)


def test_source_checkout_maps_the_repository_root(tmp_path):
    """python/pagedrun/__init__.py puts the checkout's root on pagedrun.__path__, so
    pagedrun.pyx is the checkout's pyx/ folder."""
    entry = source_checkout(tmp_path)
    proc = run_isolated(entry, "import pagedrun.pyx; print(pagedrun.pyx.__file__)")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == tmp_path / "pyx" / "__init__.py"


@pytest.mark.parametrize("statement, module", [
    ("import pagedrun.pyx.kv_cache_manager", "pagedrun.pyx.kv_cache_manager"),
    ("from pagedrun.pyx import scheduler", "pagedrun.pyx.scheduler"),
])
def test_installed_without_compiled_modules(tmp_path, statement, module):
    entry = installed_layout(tmp_path)
    proc = run_isolated(entry, "import pagedrun; assert len(pagedrun.__path__) == 1, "
                               "pagedrun.__path__\n" + statement)
    assert_build_error(proc, module)


def test_partial_build_keeps_plain_not_found(tmp_path):
    """Once the folder holds a compiled module, a name with no .pyx/.pxd there is an ordinary
    ModuleNotFoundError (a typo is not a missing build); one with a .pxd still says build."""
    entry = installed_layout(tmp_path)
    (tmp_path / "pagedrun" / "pyx" / f"other{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    proc = run_isolated(entry, "import pagedrun.pyx.nosuch")
    assert proc.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'pagedrun.pyx.nosuch'"), proc.stderr
    assert_build_error(run_isolated(entry, "import pagedrun.pyx.block_pool"),
                       "pagedrun.pyx.block_pool")


def test_built_modules_import_normally():
    """In this (built) environment the finder stays silent."""
    proc = subprocess.run(
        [sys.executable, "-c", "import pagedrun.pyx.scheduler, pagedrun.pyx.block_pool, sys; "
                               "print(sys.modules['pagedrun.pyx.scheduler'].__file__)"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO.parent))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(EXTENSION_SUFFIXES[0]), proc.stdout
