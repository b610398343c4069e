"""Fixtures of the engine tests; the helpers live in engine_helpers.py (this folder is put on
sys.path so test files import them by name)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engine_helpers import ENGINE_BACKENDS, EngineModel, random_weights, tiny_config  # noqa: E402


@pytest.fixture(scope="session", params=list(ENGINE_BACKENDS))
def tiny_model(request):
    """(ModelConfig, ModelWeights) of the tiny random Llama, once per engine backend: every
    engine test runs unchanged on the numpy, bf16-cpu and sim backends (make_engine picks the
    backend the model carries). The sim backend's attention kernels serve head_dim 64 / 128,
    so its tiny model has head_dim 64 (2 query heads, 1 KV head) instead of 16."""
    spec = ENGINE_BACKENDS[request.param]
    config = tiny_config(**spec.model_overrides)
    return EngineModel(config, random_weights(config), spec)


@pytest.fixture(scope="session")
def tiny_cpu_model():
    """The tiny random Llama (head_dim 16) for tests about one backend or device resolution."""
    config = tiny_config()
    return config, random_weights(config)


def pytest_collection_modifyitems(config, items) -> None:
    """--engine-backends: deselect the tiny_model parametrizations of other backends (tier 1
    of CI runs all three; the Cython debug and system-interpreter tiers only cpu)."""
    wanted = config.getoption("--engine-backends")
    if wanted == "all":
        return
    names = set(wanted.split(","))
    unknown = names - set(ENGINE_BACKENDS)
    if unknown:
        raise pytest.UsageError(f"--engine-backends: unknown {sorted(unknown)}; "
                                f"choose from {sorted(ENGINE_BACKENDS)}")
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        backend = spec.params.get("tiny_model") if spec is not None else None
        (drop if backend is not None and backend not in names else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
