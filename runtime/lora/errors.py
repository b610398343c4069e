"""The errors of multi-LoRA: bad settings, an unusable adapter directory, an adapter in use.

All derive from PagedRunError; the setting and request errors are ValueErrors too (vLLM raises
ValueError for the same mistakes), the load error is a ModelLoadError naming the adapter file.
"""
from __future__ import annotations

from pagedrun.runtime.errors import ModelLoadError, PagedRunError


class LoRAConfigError(PagedRunError, ValueError):
    """A LoRA setting or LoRARequest field is out of range; the message names it."""


class LoRALoadError(ModelLoadError):
    """A PEFT adapter directory cannot be served: a missing or corrupt file, an unsupported
    target module or option, a rank above max_lora_rank, a shape that does not fit the model."""


class LoRAInUseError(PagedRunError):
    """An adapter cannot be removed while running requests hold it."""
