"""Tensor parallelism: sharding, communicators (NCCL on GPUs, a deterministic ZeroMQ one on the
CPU), the worker processes and the driver's executor. See docs/architecture.md."""
