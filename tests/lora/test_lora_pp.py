"""Pipeline parallelism with adapters: each stage loads its layers' part of an adapter (and,
with tensor parallelism, its rank's shard of those) when its slot is filled; the virtual engines
share the device slots, max_loras // P each. A batch mixing two adapters and the base model,
with a request that must wait for a slot, gives PP = 1's tokens, which equal the merged dense
reference's."""
from __future__ import annotations

import numpy as np
import pytest

from lora_helpers import merged_greedy, write_peft_adapter
from test_lora_tp import VOCAB, run
from tp_helpers import make_engine, write_model_dir

from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.lora import LoRARequest
from pagedrun.runtime.model_config import ModelConfig
from pagedrun.runtime.weights import load_model_weights


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)], ids=["pp2", "pp2xtp2"])
def test_pipeline_with_adapters_matches_single_device(tmp_path, pp, tp):
    # 3 layers: stages of 2 and 1; the adapters target every projection of every layer.
    model_dir = write_model_dir(tmp_path / "m", vocab_size=VOCAB, num_key_value_heads=2,
                                num_hidden_layers=3)
    config = ModelConfig.from_model_dir(model_dir)
    loras = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(tmp_path / f"a{i}", config,
                                                                rank=8, seed=i)))
             for i in range(2)]
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(3, VOCAB, n).tolist(), lora)
            for n, lora in ((7, loras[0]), (20, loras[1]), (11, None), (3, loras[0]),
                            (5, loras[1]))]
    kw = dict(enable_lora=True, max_loras=2, max_cpu_loras=2)
    single = run(make_engine(model_dir, 1, **kw), jobs)
    engine = make_engine(model_dir, tp, pipeline_parallel_size=pp, **kw)
    try:
        assert [s.config.max_loras for s in engine.schedulers] == [1, 1]
        pipelined = run(engine, jobs)
    finally:
        engine.close()
    assert pipelined == single
    model = (config, load_model_weights(model_dir, config))
    for i, (prompt, lora) in enumerate(jobs):
        assert single[f"r{i}"] == merged_greedy(model, lora, prompt, 5)


def test_too_few_slots_for_the_virtual_engines():
    with pytest.raises(EngineConfigError, match="max_loras"):
        EngineConfig(pipeline_parallel_size=3, enable_lora=True, max_loras=2)
