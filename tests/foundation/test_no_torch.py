"""paged-run never imports torch or transformers at run time (only the fixture generator does).

Runs in a fresh interpreter, since this test process may have other modules loaded already.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

# The modules of the foundation layer; importing them must not pull in torch.
FOUNDATION_MODULES = (
    "pagedrun",
    "pagedrun.runtime.errors",
    "pagedrun.runtime.model_config",
    "pagedrun.runtime.weights",
    "pagedrun.runtime.reference",
)
FORBIDDEN_MODULES = ("torch", "transformers")


def _assert_prints_ok(check: str) -> None:
    """Runs `check` in a fresh interpreter (nothing imported yet) and expects it to print ok."""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_importing_pagedrun_does_not_import_torch() -> None:
    check = (
        "import importlib, sys\n"
        f"for name in {FOUNDATION_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = [m for m in {FORBIDDEN_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    _assert_prints_ok(check)


def test_loading_and_running_a_model_does_not_import_torch() -> None:
    """Lazy imports count too: load a tiny fixture model and run the reference forward."""
    model_dir = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen2_tied"
    check = (
        "import sys\n"
        "from pagedrun.runtime.model_config import ModelConfig\n"
        "from pagedrun.runtime.weights import load_model_weights\n"
        "from pagedrun.runtime.reference import ReferenceModel\n"
        f"config = ModelConfig.from_model_dir({str(model_dir)!r})\n"
        f"model = ReferenceModel(config, load_model_weights({str(model_dir)!r}, config))\n"
        "model.greedy_generate([5, 6, 7], 3)\n"
        f"loaded = [m for m in {FORBIDDEN_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    _assert_prints_ok(check)
