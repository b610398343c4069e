"""Tensor parallel == one device for Qwen3 (tests/fixtures/tiny/qwen3_tied: QK-norm, head_dim 64
!= hidden / heads, GQA 4/2, tied, vocabulary 307 that TP=2 does not divide): TP=2 on the numpy
backend gives TP=1's greedy tokens and logits. The per-head q/k norm weights are replicated on
every rank (each rank normalizes whole heads of its own)."""
from __future__ import annotations

import pathlib

import numpy as np

from tp_helpers import greedy_run, make_engine, prompts

QWEN3_DIR = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3_tied"
VOCAB = 307
# Logits of the sharded forward differ from one device's only by float32 summation order.
LOGITS_RTOL = 1e-5
LOGITS_ATOL = 1e-5


def test_qwen3_tp2_matches_single_device():
    ps = prompts(VOCAB)
    kwargs = {"max_model_len": 128}
    ref_tokens, ref_logits = greedy_run(make_engine(str(QWEN3_DIR), 1, **kwargs), ps, 8)
    engine = make_engine(str(QWEN3_DIR), 2, **kwargs)
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
