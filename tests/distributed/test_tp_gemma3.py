"""Tensor parallel == one device for Gemma 3 (tests/fixtures/tiny/gemma3_tiny: (1 + w) norms
folded at load, the norms around attention and MLP, QK-norm, GeGLU, embedding scale, sliding
local layers with their own RoPE base): TP=2 on the numpy backend gives TP=1's greedy tokens
and logits. A rank reads the checkpoint's w and folds 1 + w itself (runtime/distributed/
sharding.py load_shard), so a missed fold or norm shows here."""
from __future__ import annotations

import pathlib

import numpy as np

from tp_helpers import greedy_run, make_engine, prompts

GEMMA3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "gemma3_tiny"
VOCAB = 256
# Logits of the sharded forward differ from one device's only by float32 summation order; the
# sqrt(hidden)-scaled embeddings and the extra norms make that a little larger than for Llama
# (measured: 1.1e-5 at most on this fixture).
LOGITS_RTOL = 1e-5
LOGITS_ATOL = 5e-5


def test_gemma3_tp2_matches_single_device():
    ps = prompts(VOCAB)
    kwargs = {"max_model_len": 128}
    ref_tokens, ref_logits = greedy_run(make_engine(str(GEMMA3_DIR), 1, **kwargs), ps, 8)
    engine = make_engine(str(GEMMA3_DIR), 2, **kwargs)
    try:
        tokens, logits = greedy_run(engine, ps, 8)
        assert engine.runner.dead is None
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        assert got.shape == want.shape and got.shape[1] == VOCAB
        np.testing.assert_allclose(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
