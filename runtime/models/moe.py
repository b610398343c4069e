"""The mixture-of-experts MLP of the Llama-family forward (Mixtral, Qwen3-MoE): a router GEMM,
then the backend's two MoE ops.

    router_logits = h @ router.T                          [num_tokens, num_experts] float32
    topk_ids, topk_weights = ops.moe_route(router_logits, top_k, renormalize)
    y = ops.moe_experts(h, topk_ids, topk_weights, w_gate_up, w_down)

The ops' contract (shapes, tie order, grouping by expert) is in runtime/backends/base.py and
numpy_ops.moe_route / moe_experts; here is only what the model owns: the weights in the layout
those ops take, and the config's top-k and normalization. LlamaModel builds one `MoeBlock` per
layer in config.moe_layers and runs it where the dense SwiGLU MLP would run, so attention, the
norms, the residual stream and tensor parallelism (a rank's experts hold its slice of the
intermediate features; y is a partial sum all-reduced like the dense down_proj's) stay shared.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import LayerWeights


@dataclass
class MoeBlock:
    router_t: np.ndarray   # [hidden, num_experts] float32 (pre-transposed, like llama.py's)
    w_gate_up: np.ndarray  # [num_experts, 2 * intermediate, hidden] float32: gate rows, up rows
    w_down: np.ndarray     # [num_experts, hidden, intermediate] float32
    top_k: int
    renormalize: bool

    @classmethod
    def from_weights(cls, layer: LayerWeights, config: ModelConfig) -> "MoeBlock":
        if layer.router is None or layer.experts_gate_up is None or layer.experts_down is None:
            # A loader that forgot them would silently run a different model.
            raise ValueError(f"{config.architecture}: router / expert weights missing")
        return cls(
            router_t=np.ascontiguousarray(layer.router.T, dtype=np.float32),
            w_gate_up=np.ascontiguousarray(layer.experts_gate_up, dtype=np.float32),
            w_down=np.ascontiguousarray(layer.experts_down, dtype=np.float32),
            top_k=config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
        )

    def __call__(self, ops, h):
        """h: [num_tokens, hidden] (post-attention-normed) -> [num_tokens, hidden] float32."""
        router_logits = ops.linear(h, self.router_t.T, out_dtype=np.float32)
        topk_ids, topk_weights = ops.moe_route(router_logits, self.top_k, self.renormalize)
        return ops.moe_experts(h, topk_ids, topk_weights, self.w_gate_up, self.w_down)
