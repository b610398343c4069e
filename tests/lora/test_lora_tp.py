"""Tensor parallelism with adapters: at TP=2 every rank loads its own shard of each adapter
(column-parallel B rows, row-parallel A columns) when its slot is filled, and a batch mixing
two adapters and the base model under one slot too few (so a request waits and a slot is
refilled mid-run) gives TP=1's tokens, which equal the merged dense reference's."""
from __future__ import annotations

import numpy as np

from lora_helpers import merged_greedy, write_peft_adapter
from tp_helpers import make_engine, write_model_dir

from pagedrun.runtime.lora import LoRARequest
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.sampling_params import SamplingParams
from pagedrun.runtime.weights import load_model_weights

VOCAB = 389


def run(engine, jobs):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=params,
                           **({} if lora is None else {"lora_request": lora}))
    tokens = {f"r{i}": [] for i in range(len(jobs))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return tokens


def test_tp2_with_adapters_matches_tp1(tmp_path):
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, num_key_value_heads=2)
    config = ModelConfig.from_model_dir(model_dir)
    loras = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(tmp_path / f"a{i}", config,
                                                                rank=8, seed=i)))
             for i in range(2)]
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(3, VOCAB, n).tolist(), lora)
            for n, lora in ((7, loras[0]), (20, loras[1]), (11, None), (3, loras[0]))]
    kw = dict(enable_lora=True, max_loras=1, max_cpu_loras=2)
    tp1 = run(make_engine(model_dir, 1, **kw), jobs)
    engine = make_engine(model_dir, 2, **kw)
    try:
        tp2 = run(engine, jobs)
    finally:
        engine.close()
    assert tp2 == tp1
    model = (config, load_model_weights(model_dir, config))
    for i, (prompt, lora) in enumerate(jobs):
        assert tp1[f"r{i}"] == merged_greedy(model, lora, prompt, 5)
