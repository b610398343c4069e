"""The Python engine: model loading, the reference forward, backends, model runner, engine."""
