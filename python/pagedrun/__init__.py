"""paged-run: PagedAttention and continuous batching with hand-written CUDA kernels, no PyTorch.

The import package maps the repository's top-level folders:
``pagedrun.runtime`` (runtime/), ``pagedrun.server`` (server/), ``pagedrun.pyx`` (pyx/, compiled)
and ``pagedrun/cuda`` (cuda/, kernel sources shipped as data).

Heavy names are imported lazily so that ``import pagedrun`` stays fast and never pulls in torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("pagedrun.runtime.llm", "LLM"),
    "SamplingParams": ("pagedrun.runtime.sampling_params", "SamplingParams"),
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
