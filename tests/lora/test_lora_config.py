"""LoRARequest and LoRAConfig validation: vLLM's names and defaults, clear errors."""
from __future__ import annotations

import pathlib

import pytest

from pagedrun.runtime.errors import PagedRunError
from pagedrun.runtime.lora import LoRAConfig, LoRARequest
from pagedrun.runtime.lora.errors import LoRAConfigError


def test_request_fields_and_positional_order():
    request = LoRARequest("sql", 3, pathlib.Path("/adapters/sql"))
    assert (request.lora_name, request.lora_int_id, request.lora_path) == (
        "sql", 3, "/adapters/sql")
    assert request.adapter_id == 3
    assert request == LoRARequest(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql")
    assert len({request, LoRARequest("sql", 3, "/adapters/sql")}) == 1  # hashable, by value


@pytest.mark.parametrize("lora_int_id, message", [
    (0, "lora_int_id must be > 0, got 0"),
    (-2, "lora_int_id must be > 0, got -2"),
    (True, "lora_int_id must be an int, got bool"),
    (1.0, "lora_int_id must be an int, got float"),
    ("1", "lora_int_id must be an int, got str"),
])
def test_request_id_must_be_a_positive_int(lora_int_id, message):
    with pytest.raises(LoRAConfigError) as info:
        LoRARequest("a", lora_int_id, "/p")
    assert str(info.value) == message
    assert isinstance(info.value, ValueError) and isinstance(info.value, PagedRunError)


@pytest.mark.parametrize("name", ["", None, 5])
def test_request_name_must_be_a_non_empty_string(name):
    with pytest.raises(LoRAConfigError, match="lora_name must be a non-empty string"):
        LoRARequest(name, 1, "/p")


def test_request_path_must_be_a_path():
    with pytest.raises(LoRAConfigError, match="lora_path must be a path"):
        LoRARequest("a", 1, 7)


def test_config_defaults_are_vllms():
    config = LoRAConfig()
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (1, 16, 1)
    assert LoRAConfig(max_loras=4).max_cpu_loras == 4   # None -> max_loras
    assert LoRAConfig(max_loras=2, max_cpu_loras=5).max_cpu_loras == 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=0), "max_loras must be >= 1, got 0"),
    (dict(max_loras=2.0), "max_loras must be an int, got 2.0"),
    (dict(max_lora_rank=0), "max_lora_rank must be >= 1, got 0"),
    (dict(max_lora_rank=12), "max_lora_rank (12) must be one of (1, 8, 16, 32, 64, 128, 256, "
                             "320, 512)"),
    (dict(max_cpu_loras=0), "max_cpu_loras must be >= 1, got 0"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras (2) must be >= max_loras (4)"),
    (dict(max_loras=True), "max_loras must be an int, got True"),
])
def test_config_errors_name_the_setting(kwargs, message):
    with pytest.raises(LoRAConfigError) as info:
        LoRAConfig(**kwargs)
    assert str(info.value) == message
