"""Loads tests/foundation/tiny_gguf.py once for every foundation test module.

pytest runs with --import-mode=importlib, so this folder is not on sys.path and `import
tiny_gguf` would fail. pytest imports this conftest before collecting any test module below it
(also when a single file is run), so registering the helper in sys.modules here lets each test
module write `import pagedrun_tests_tiny_gguf as tiny_gguf` -- one load, one module object.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The sys.modules name of tiny_gguf.py; prefixed so it cannot shadow an installed package.
TINY_GGUF_MODULE = "pagedrun_tests_tiny_gguf"


def _register_tiny_gguf() -> None:
    if TINY_GGUF_MODULE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        TINY_GGUF_MODULE, Path(__file__).with_name("tiny_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    # Registered before exec_module so dataclasses in it can resolve their own module.
    sys.modules[TINY_GGUF_MODULE] = module
    spec.loader.exec_module(module)


_register_tiny_gguf()
