"""LoRAConfig: how many adapters fit where, under vLLM's names.

    LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=8)

- max_loras: device slots, i.e. distinct adapters one step can run (vLLM default 1);
- max_lora_rank: the largest adapter rank accepted; the slot stacks are sized for it, smaller
  ranks are zero-padded (vLLM default 16, one of vLLM's supported values);
- max_cpu_loras: adapters kept loaded in host memory (LRU); None means max_loras, and it may
  not be below max_loras (every resident adapter is also a host one).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedrun.runtime.lora.errors import LoRAConfigError

# The ranks vLLM accepts for max_lora_rank (its LoRAConfig check); kept so that a command line
# written for vLLM means the same here.
SUPPORTED_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LoRAConfigError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise LoRAConfigError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank not in SUPPORTED_MAX_LORA_RANKS:
            raise LoRAConfigError(f"max_lora_rank ({self.max_lora_rank}) must be one of "
                                  f"{SUPPORTED_MAX_LORA_RANKS}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise LoRAConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= "
                                  f"max_loras ({self.max_loras})")
