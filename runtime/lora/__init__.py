"""Multi-LoRA serving, the device-free parts: the request and config objects (vLLM's names),
the PEFT adapter loader (per-projection A/B mapped onto our fused QKV and gate-up weights, tensor-
parallel shards), the adapter cache (device slots, LRU, pins), the slot-stacked weights and the
numpy shrink / expand ops over a step's tokens grouped by adapter slot.

The CUDA kernels of the same ops are cuda/lora.cu (launch wrappers: runtime/kernels/lora.py).
"""
from pagedrun.runtime.lora.adapter_files import ADAPTER_FILES
from pagedrun.runtime.lora.lora_config import LoRAConfig
from pagedrun.runtime.lora.lora_request import LoRARequest

__all__ = ["ADAPTER_FILES", "LoRAConfig", "LoRARequest"]
