"""Backends: the ops the model forward is written against.

- `numpy_ops`: the CPU backend and the reference every CUDA kernel is tested against. Each op
  takes exactly the arguments, cache layout, `slot_mapping` and `block_tables` its kernel sees.
- cuda / sim backends (CuPy arrays + `cuda/*.cu`, or the same sources on CPU threads) expose the
  same op names and signatures; they live in sibling modules owned by the kernel engineers.
"""
