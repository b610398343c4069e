"""Tensor parallel == one device for every model family beyond Llama/Mistral/Qwen2: TP=2 on the
numpy backend gives TP=1's greedy tokens and logits on each tiny fixture (tests/fixtures/tiny).

What each fixture checks of the sharding (runtime/distributed/sharding.py):
- qwen3_tied: per-head q/k norms replicated (a rank norms whole heads of its own); head_dim 64
  != hidden / heads; a vocabulary (307) that TP=2 does not divide.
- mixtral_moe, qwen3_moe: the router replicated and half of every expert's intermediate
  features per rank (gate and up rows, down columns), so a rank routes every token exactly as
  one device does and its expert output is a partial sum all-reduced like the dense down_proj's;
  Qwen3-MoE's dense layer (mlp_only_layers) split as any dense MLP.
- gemma3_tiny: a rank reads the checkpoint's w and folds Gemma's 1 + w itself, for the norms
  around attention and MLP too (a missed fold or norm shows here).
- phi3_tiny: a rank's heads of q, k and v out of one fused qkv_proj and its features of gate
  and up out of one gate_up_proj (test_tp_phi3.py checks the shards themselves).
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from pagedrun.runtime.model_config import ModelConfig
from tp_helpers import greedy_run, make_engine, prompts

TINY_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
# Logits of the sharded forward differ from one device's only by float32 summation order.
LOGITS_RTOL = 1e-5
# Gemma 3's sqrt(hidden)-scaled embeddings and extra norms make that order's effect a little
# larger (measured: 1.1e-5 at most on its fixture); Phi-3's width-256 partial sums moved logits
# of magnitude ~5 by 2.3e-5 at most (a wrong shard moves them by whole units).
LOGITS_ATOL = {"qwen3_tied": 1e-5, "mixtral_moe": 1e-5, "qwen3_moe": 1e-5, "gemma3_tiny": 5e-5,
               "phi3_tiny": 1e-4}
# Phi-3's fixture slides a window of 7 over every layer, to which the engine caps
# max_model_len: its prompts and generations stay within it (1-3 prompt tokens, 4 new ones).
SHORT_WINDOW = {"phi3_tiny": (1, 2, 3)}


@pytest.mark.parametrize("name", sorted(LOGITS_ATOL))
def test_tp2_matches_single_device(name):
    model_dir = TINY_DIR / name
    config = ModelConfig.from_model_dir(model_dir)
    vocab = config.vocab_size
    if name in SHORT_WINDOW:
        rng = np.random.default_rng(3)
        ps = [rng.integers(3, vocab, n).tolist() for n in SHORT_WINDOW[name]]
        kwargs = {"max_model_len": config.sliding_window, "block_size": 16,
                  "max_num_batched_tokens": 4}
        num_tokens = 4
    else:
        ps, kwargs, num_tokens = prompts(vocab), {"max_model_len": 128}, 8
    ref_tokens, ref_logits = greedy_run(make_engine(str(model_dir), 1, **kwargs), ps, num_tokens)
    engine = make_engine(str(model_dir), 2, **kwargs)
    try:
        tokens, logits = greedy_run(engine, ps, num_tokens)
        assert engine.runner.dead is None
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        assert got.shape == want.shape and got.shape[1] == vocab
        np.testing.assert_allclose(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL[name])
