"""The files of a PEFT adapter directory: what runtime/lora/peft_loader.py reads, and what the
server checks (as regular files, by stat) before a runtime LOAD_LORA may read them."""

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_FILES", "ADAPTER_WEIGHTS_FILE"]
