"""The model registry's model side: which model class runs an architecture, and which loader
reads its weights.

runtime/architectures.py (below this layer) lists the architectures and names each one's
forward; `FORWARDS` here turns that name into the class and the weight loader. Every
registered architecture runs today on the Llama forward (runtime/models/llama.py), whose
variants (biases, sliding window, Qwen3's QK-norm, mixture-of-experts layers through
runtime/models/moe.py, Gemma 3's norms, GeGLU and local layers) are config fields; a family
the Llama forward cannot express adds its module here and one `FORWARDS` entry.

    model = build_model(config, weights, ops, max_position)   # what ModelRunner needs
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedrun.runtime.architectures import LLAMA_FORWARD, find_architecture
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.models.llama import LlamaModel
from pagedrun.runtime.models.tensor_parallel import SINGLE_DEVICE
from pagedrun.runtime.weights import load_model_weights


@dataclass(frozen=True)
class Forward:
    # model_class(config, weights, ops, max_position): the forward of one rank.
    model_class: type
    # load_weights(model_dir, config, dtype) -> ModelWeights (runtime/weights.py).
    load_weights: Callable


FORWARDS: dict[str, Forward] = {
    LLAMA_FORWARD: Forward(LlamaModel, load_model_weights),
}


def forward_of(config: ModelConfig) -> Forward:
    """The model class and weight loader of `config.architecture`; KeyError if unregistered
    (ModelConfig.from_dict already refuses those, with the supported list)."""
    architecture = find_architecture(config.architecture)
    if architecture is None:
        raise KeyError(f"architecture {config.architecture!r} is not registered")
    return FORWARDS[architecture.forward]


def build_model(config: ModelConfig, weights, ops, max_position: int, *, first_layer: int = 0,
                tp=SINGLE_DEVICE):
    """The forward of `config`'s architecture over `weights`, on backend `ops`. A pipeline
    stage's model starts at model-wide layer `first_layer`; a tensor-parallel rank's gets its
    `tp` (runtime/distributed/tensor_parallel.py; config and weights are then the rank's)."""
    return forward_of(config).model_class(config, weights, ops, max_position,
                                          first_layer=first_layer, tp=tp)
