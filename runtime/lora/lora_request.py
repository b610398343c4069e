"""LoRARequest: which adapter a request runs with, under vLLM's names.

    LoRARequest("sql", 1, "/adapters/sql-lora")    # lora_name, lora_int_id, lora_path

`lora_int_id` is the adapter's identity everywhere below (adapter cache, device slot, prefix-cache
block hashes); it must be a positive int, since 0 would read as "no adapter" in places that
test truthiness. `lora_name` is what the server's protocol and model info show.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pagedrun.runtime.lora.errors import LoRAConfigError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAConfigError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        # bool is an int subclass: True would silently become adapter 1.
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise LoRAConfigError(
                f"lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise LoRAConfigError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise LoRAConfigError(f"lora_path must be a path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def adapter_id(self) -> int:
        """The id the cache, the slots and the block hashes key on (= lora_int_id)."""
        return self.lora_int_id
