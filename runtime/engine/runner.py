"""Runner: what the engine's steppers ask of whoever runs the model.

Two implementations: one device's ModelRunner (runtime/model_runner.py) and the tensor /
pipeline-parallel executor (runtime/distributed/executor.py), which fans the same calls out to
its ranks. The engine names neither; it builds one (runtime/engine/runner_setup.py) and talks
to it only through this protocol. KV sizes are fixed once the pools are placed.
"""
from __future__ import annotations

from typing import Protocol


class Runner(Protocol):
    # Virtual engines the runner keeps in flight: 1, or the pipeline's number of stages (one
    # batch in flight per stage, PipelinedStepper).
    pipeline_depth: int
    num_gpu_blocks: int   # KV blocks per virtual engine
    num_cpu_blocks: int   # host swap blocks

    def kv_bytes_per_block(self) -> int:
        """Device bytes of one KV block across every layer (this rank's share)."""

    def execute(self, out, prompt_logit_rows: tuple[int, ...] = (), row_lora_slots=None,
                **kwargs):
        """Run SchedulerOutput `out`: block moves, the forward, the logits of the sampling
        rows (and of `prompt_logit_rows`' every query token). Returns a RunnerOutput."""

    def submit(self, out, prompt_logit_rows: tuple[int, ...], row_lora_slots, virtual_engine: int):
        """Pipelined: start `out` through the stages; returns a handle for `collect`."""

    def collect(self, out, handle):
        """Pipelined: the RunnerOutput of a submitted batch (waits for its last stage)."""

    def load_adapter(self, lora_request):
        """This runner's part of a LoRA adapter, read from disk (the AdapterCache's loader)."""

    def apply_lora_writes(self, writes) -> None:
        """Fill the device adapter slots the AdapterCache placed."""

    def close(self) -> None:
        """Release workers and devices; idempotent."""
