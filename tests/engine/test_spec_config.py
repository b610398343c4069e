"""EngineConfig's speculative_config (vLLM's name) and its reader spec_config(): a dict or a
SpeculativeConfig in, a validated SpeculativeConfig (or None: off) out, errors as
EngineConfigError naming the field; `LLM(speculative_config=...)` reaches the EngineConfig.
SpeculativeConfig's own validation is tested in test_ngram_proposer.py.
"""
from __future__ import annotations

import pytest

from pagedrun.runtime import llm as llm_module
from pagedrun.runtime.engine_config import EngineConfig, EngineConfigError
from pagedrun.runtime.spec_decode.spec_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def test_off_by_default():
    assert EngineConfig().speculative_config is None
    assert EngineConfig().spec_config() is None


def test_dict_becomes_a_speculative_config():
    spec = EngineConfig(speculative_config={**NGRAM, "disable_by_batch_size": 16}).spec_config()
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max,
            spec.prompt_lookup_min, spec.model, spec.disable_by_batch_size) == \
        ("ngram", 4, 4, 2, None, 16)
    draft = EngineConfig(speculative_config={"model": "/d", "num_speculative_tokens": 3})
    assert (draft.spec_config().method, draft.spec_config().model) == ("draft_model", "/d")


def test_speculative_config_object_is_kept():
    spec = SpeculativeConfig(**NGRAM)
    assert EngineConfig(speculative_config=spec).spec_config() is spec


def test_tensor_parallel_is_no_restriction():
    config = EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)
    assert config.spec_config().num_speculative_tokens == 4


@pytest.mark.parametrize("value,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "speculative_config"),
    ('{"method": "ngram"}', "speculative_config"),  # JSON text belongs to the CLI
])
def test_bad_value_is_an_engine_config_error_naming_the_field(value, field):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(speculative_config=value)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_llm_passes_speculative_config_to_engine_config(monkeypatch):
    built = []

    class CapturingEngine:  # no model is loaded: only the EngineConfig LLM builds matters
        def __init__(self, config):
            built.append(config)

    monkeypatch.setattr(llm_module, "LLMEngine", CapturingEngine)
    llm_module.LLM(model="some/model", device="cpu", speculative_config=NGRAM)
    assert built[0].spec_config().prompt_lookup_min == 2
