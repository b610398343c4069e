"""Model families as data: the registry's vocabulary (`base`: Architecture, tensor maps) and one
module per family whose entry is more than a few lines (runtime/architectures.py lists them)."""
