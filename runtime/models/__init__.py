"""Model forwards written against backend ops (one module per architecture family)."""
