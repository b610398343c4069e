"""The engine: add_request / abort_request / step() = schedule -> execute -> sample ->
postprocess, as a small package read top-down.

Design note. The seam (docs/engine_api.md) is string request ids and SamplingParams in,
RequestOutputs out. Inside, each of a request's n sequences is one scheduler request (an int
id). Every step runs the same skeleton (step.py):
  1. the scheduler hands out the token budget and emits a SchedulerOutput (before it, a
     speculating engine proposes drafts: spec_decode/spec_step.py);
  2. the sampling plan says which sequence samples from which logits row (an n > 1 request
     expands here; sampling_plan.py) and which adapter slot each row uses (lora/pinning.py);
  3. the runner moves blocks, runs the forward and returns the logits (runner.py names what
     the steppers may ask of it);
  4. the sampler draws one token per sampling row; rows with drafts are verified instead;
  5. the output processor appends, stop-checks and detokenizes (output_processor.py); the
     scheduler is told (finished blocks free at once); n > 1 siblings fork onto their parent's
     blocks; each request's output leaves as its output_kind asks.
Which stepper drives the skeleton (chosen once, LLMEngine's docstring): SyncStepper (one step
at a time), PipelinedStepper (pipeline parallelism: one batch in flight per stage, each on its
own virtual engine), AsyncStepper (step N+1 launched before step N's tokens are read).
Faults are contained per request and per step (step.py's docstring). KV capacity is fixed at
construction; requests that can never run are refused at admission (core.py). The device is
the backend's business: the engine reads the backend's declared capabilities and never
branches on a device string.
"""
# RequestError, DeviceNotAvailableError and the ERR_* codes live in runtime/errors.py; they are
# exported here too because `from pagedrun.runtime.engine import RequestError` is public API,
# as LoRARequest is (add_request takes it; the server imports it from here).
from pagedrun.runtime.errors import (ERR_CAPACITY, ERR_DUPLICATE, ERR_EMPTY,  # noqa: F401
                                     ERR_INVALID, ERR_TOO_LONG, DeviceNotAvailableError,
                                     MAX_ERROR_CHARS, PagedRunError, RequestError)
from pagedrun.runtime.lora.lora_request import LoRARequest  # noqa: F401
from pagedrun.runtime.lora.pinning import LORA_SALT_BIT  # noqa: F401

from .core import LLMEngine
from .step import MAX_CONSECUTIVE_STEP_FAILURES, EngineDeadError

__all__ = ["LLMEngine", "EngineDeadError", "MAX_CONSECUTIVE_STEP_FAILURES", "RequestError",
           "DeviceNotAvailableError", "LoRARequest"]
