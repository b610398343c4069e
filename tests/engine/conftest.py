"""Fixtures of the engine tests; the helpers live in engine_helpers.py (this folder is put on
sys.path so test files import them by name)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engine_helpers import random_weights, tiny_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    """(ModelConfig, ModelWeights) of the tiny random Llama."""
    config = tiny_config()
    return config, random_weights(config)
