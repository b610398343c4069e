"""Model loading: what a model name means on this node, and the config, weights and tokenizer
it yields. Owned here so the engine, the tensor-parallel workers and the CLI resolve a model
the same way (and the engine holds no loading code).

    model_dir = resolve_model_dir(None)                  # the embedded default model
    config, weights, tokenizer = load_model("m.gguf")    # converted once, then cached
"""
from __future__ import annotations

import os

import numpy as np

from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.model_config import ModelConfig


GGUF_SUFFIX = ".gguf"


def resolve_model_dir(model: str | os.PathLike | None, progress: bool = True) -> str:
    """The HF directory of `model`: a directory as is, a .gguf converted once into the cache
    (runtime/paths.py), or the default model when None. `progress`: a bar while converting.
    Raises ModelLoadError when `model` is neither a directory nor a .gguf file."""
    from pathlib import Path

    from pagedrun.runtime.default_model import default_model_dir, ensure_converted
    from pagedrun.runtime.paths import models_cache_dir

    if model is None:
        return str(default_model_dir(progress=progress))
    path = Path(model)
    if path.is_file() and path.name.lower().endswith(GGUF_SUFFIX):
        return str(ensure_converted(path, models_cache_dir(), progress=progress))
    if not path.is_dir():
        raise ModelLoadError(path, "no such model directory or .gguf file")
    return str(path)


def load_model(model: str | os.PathLike | None, load_weights: bool = True):
    """(ModelConfig, ModelWeights | None, Tokenizer | None) from an HF directory, a .gguf, or
    None (the default model). Tensor parallel: no weights here, each rank reads its own shard."""
    from pagedrun.runtime.tokenizer import TOKENIZER_FILE, Tokenizer
    from pagedrun.runtime.weights import load_model_weights

    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_model_dir(model_dir)
    weights = load_model_weights(model_dir, config, np.float32) if load_weights else None
    tokenizer = (Tokenizer.from_dir(model_dir)
                 if os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)) else None)
    return config, weights, tokenizer
