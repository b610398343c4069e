"""Tensor parallel == one device: TP=2 and TP=4 on the numpy backend (and TP=2 on the sim
backend, the real kernels) give TP=1's greedy tokens and logits, for a vocabulary no TP size
divides, GQA with KV heads split (TP=2) and replicated (2 KV heads at TP=4), biases on q/k/v/o
(o_proj's bias added once), and tied embeddings. Every engine spawns real worker processes."""
from __future__ import annotations

import numpy as np
import pytest

from tp_helpers import greedy_run, make_engine, prompts, write_model_dir

# Logits of the sharded forward differ from one device's only by float32 summation order.
LOGITS_RTOL = 1e-5
LOGITS_ATOL = 1e-5
# bf16 (8-bit mantissa): a few rounding steps of the largest logit.
BF16_LOGITS_REL = 0.02
VOCAB = 389  # prime: no TP size divides it, the last rank's vocabulary slice is padded


def _compare(model_dir, tp, device="cpu", max_tokens=8, **kw):
    ps = prompts(VOCAB)
    ref = make_engine(model_dir, 1, device=device, **kw)
    ref_tokens, ref_logits = greedy_run(ref, ps, max_tokens)
    engine = make_engine(model_dir, tp, device=device, **kw)
    try:
        tokens, logits = greedy_run(engine, ps, max_tokens)
    finally:
        engine.close()
    assert tokens == ref_tokens
    # KV capacity is sized per rank: a block holds only the rank's KV heads (one when replicated).
    kv_heads = ref.model_config.num_key_value_heads
    assert engine.bytes_per_block * kv_heads == ref.bytes_per_block * max(1, kv_heads // tp)
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        assert got.shape == want.shape and got.shape[1] == VOCAB
        np.testing.assert_allclose(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
    return engine


@pytest.mark.parametrize("tp,num_kv_heads,extra", [
    (2, 2, {}),                                            # KV heads split 1 + 1
    (4, 2, {}),                                            # GQA: 2 KV heads replicated on 4 ranks
    (4, 4, {"attention_bias": True}),                      # MHA, biases on q/k/v/o
    (2, 1, {"tie_word_embeddings": True}),                 # MQA, tied vocab-parallel head
], ids=["tp2-kv2", "tp4-kv2-gqa", "tp4-kv4-bias", "tp2-mqa-tied"])
def test_numpy_tp_matches_single_device(tmp_path, tp, num_kv_heads, extra):
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB,
                                num_key_value_heads=num_kv_heads, **extra)
    engine = _compare(model_dir, tp)
    assert engine.runner.dead is None


def test_sim_tp2_matches_single_device(tmp_path):
    """The real kernels (cuda/*.cu on the CPU harness) at TP=2, float32; head_dim 64 is one the
    attention kernels serve."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, hidden_size=128,
                                num_attention_heads=2, num_key_value_heads=2)
    _compare(model_dir, 2, device="sim", max_tokens=3)


def test_sim_tp2_bfloat16(tmp_path):
    """bf16 activations (uint16 bits) through the CPU communicator: each rank's partial sum is
    rounded to bf16 before the float32 all-reduce, so logits differ from TP=1 at bf16 rounding
    level (the seeds make this deterministic: the greedy tokens agree)."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, hidden_size=128,
                                num_attention_heads=2, num_key_value_heads=2)
    ps = prompts(VOCAB)[:3]
    ref_tokens, ref_logits = greedy_run(make_engine(model_dir, 1, device="sim",
                                                    dtype="bfloat16"), ps, 3)
    engine = make_engine(model_dir, 2, device="sim", dtype="bfloat16")
    try:
        tokens, logits = greedy_run(engine, ps, 3)
    finally:
        engine.close()
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        scale = float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= BF16_LOGITS_REL * scale


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sim_tp2_decode_graphs(tmp_path, tied):
    """Decode graphs on every rank (runtime/decode_graphs.py): the captured region holds the
    masked embedding over the static token buffer, the all-reduces and the logits gather (host
    steps of the CPU communicator, replayed in step on both ranks), and gives TP=1 eager's
    tokens and logits."""
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, hidden_size=128,
                                num_attention_heads=2, num_key_value_heads=2,
                                tie_word_embeddings=tied)
    ps = prompts(VOCAB)
    ref_tokens, ref_logits = greedy_run(make_engine(model_dir, 1, device="sim",
                                                    enforce_eager=True), ps, 5)
    engine = make_engine(model_dir, 2, device="sim", cuda_graph_sizes=(1, 2, 4))
    try:
        tokens, logits = greedy_run(engine, ps, 5)
        replays = engine.runner.runner.decode_graphs.replays  # rank 0's runner
    finally:
        engine.close()
    assert tokens == ref_tokens
    assert replays[4] > 0
    for got, want in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)
