"""paged-run: PagedAttention and continuous batching with hand-written CUDA kernels, no PyTorch.

The import package maps the repository's top-level folders:
``pagedrun.runtime`` (runtime/), ``pagedrun.server`` (server/), ``pagedrun.pyx`` (pyx/, compiled)
and ``pagedrun/cuda`` (cuda/, kernel sources shipped as data).

Heavy names are imported lazily so that ``import pagedrun`` stays fast and never pulls in torch.
"""
from __future__ import annotations

__version__ = "0.1.0"


def _source_checkout_root() -> str | None:
    """The repository root when this file is python/pagedrun/__init__.py of a source checkout
    rather than an installed wheel. There the subpackages live in the root's runtime/,
    server/, pyx/ and cuda/ folders (the wheel maps them under pagedrun/), so the root goes on
    this package's __path__, as the editable install's finder does too. Then importing a
    Cython module of a checkout that was never built reaches pyx/__init__.py, whose ImportError
    says how to build it, instead of "No module named 'pagedrun.pyx'"."""
    import os

    python_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(python_dir)
    if (os.path.basename(python_dir) == "python"
            and os.path.isfile(os.path.join(root, "pyproject.toml"))
            and os.path.isfile(os.path.join(root, "pyx", "__init__.py"))):
        return root
    return None


_root = _source_checkout_root()
if _root is not None and _root not in __path__:
    __path__.append(_root)
del _root

_LAZY = {
    "LLM": ("pagedrun.runtime.llm", "LLM"),
    "SamplingParams": ("pagedrun.runtime.sampling_params", "SamplingParams"),
    "LoRARequest": ("pagedrun.runtime.lora.lora_request", "LoRARequest"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedrun' has no attribute {name!r}")
