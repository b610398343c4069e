"""The gateway's own tokenizer: what /tokenize and /detokenize answer with, and the text of
token-id prompts (`echo`) and of logprob tokens an engine sent without `decoded_token`.

The ZeroMQ protocol has no tokenize message, and none is added: the tokenizer is a file next to
the model, and text <-> ids needs no engine step, so the gateway loads it itself
(`pagedrun.runtime.tokenizer.Tokenizer`, the class the engine uses, so both produce the same
ids). Where from: `--tokenizer MODEL` (a model directory, a .gguf, or `default`), else the model
the engine reports in MODEL_INFO when that names something on this machine (a directory, a
.gguf, or `default`: the embedded default model, converted once into the cache). `serve
--http-port` hands the gateway the engine's own tokenizer object. Without one, /tokenize and
/detokenize answer 501 and everything else works (the engine tokenizes prompts itself).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("pagedrun.http")

DEFAULT_MODEL = "default"  # what LLMEngine reports as its model name for the default model


def load_tokenizer(model: str | None):
    """The Tokenizer of `model` (a directory, a .gguf, or "default"/None: the default model).
    Raises the runtime's ModelLoadError (or OSError) when it cannot be loaded."""
    from pagedrun.runtime.model_loader import resolve_model_dir
    from pagedrun.runtime.tokenizer import TOKENIZER_FILE, Tokenizer

    model_dir = resolve_model_dir(None if model in (None, DEFAULT_MODEL) else model,
                                  progress=False)
    if not os.path.isfile(os.path.join(model_dir, TOKENIZER_FILE)):
        return None
    return Tokenizer.from_dir(model_dir)


def tokenizer_for_engine(model_name: str | None):
    """The tokenizer of the model an engine reports (MODEL_INFO `model`), when that names a
    model on this machine; else None (logged: /tokenize and /detokenize are then 501)."""
    if model_name != DEFAULT_MODEL and not (model_name and os.path.exists(model_name)):
        log.info("no local tokenizer for the engine's model %r (give --tokenizer): /tokenize "
                 "and /detokenize are unavailable", model_name)
        return None
    try:
        return load_tokenizer(model_name)
    except Exception as exc:  # noqa: BLE001 -- optional: the gateway works without it
        log.warning("could not load the tokenizer of %r: %s", model_name, exc)
        return None
