"""The synchronous and the pipelined stepper: when the step skeleton's phases run.

SyncStepper: one virtual engine, one step at a time -- launch (the runner's execute) and
complete in the same call. PipelinedStepper (pipeline parallelism, runtime/distributed/
pipeline.py): one batch in flight per stage, each on its own virtual engine (a scheduler with
its own share of the KV blocks); each call completes the next engine's batch in flight (its
collect), admits the requests added meanwhile, then launches its next batch (submit), whose
later stages run while this process steps the other engines. A request's results arrive one
round (pipeline_parallel_size steps) after its batch was submitted.
Both use the skeleton's and the runner's public methods only (runtime/engine/step.py).
"""
from __future__ import annotations

from pagedrun.runtime.errors import describe_fault
from pagedrun.runtime.outputs import RequestOutput

from .step import LaunchedStep, StepSkeleton


class SyncStepper:
    def __init__(self, skeleton: StepSkeleton) -> None:
        self.skeleton = skeleton

    def step(self) -> list[RequestOutput]:
        skeleton = self.skeleton
        touched = skeleton.begin()
        if skeleton.table.requests:
            runner = skeleton.runner
            launched = skeleton.launch(0, touched, lambda s: runner.execute(
                s.scheduled, s.batch.prompt_logit_rows, row_lora_slots=s.lora_slots),
                with_draft=True)
            if launched is not None:
                skeleton.complete(launched, touched, lambda: launched.handle)
        return skeleton.outputs(touched)

    def has_in_flight(self) -> bool:
        return False

    def defer_admission(self, ve: int, request, admission) -> bool:
        """Keep a new request's admission for later when ve's scheduler cannot take it now;
        True when kept. A synchronous step never holds a scheduler between calls."""
        return False


class PipelinedStepper:
    def __init__(self, skeleton: StepSkeleton, admit) -> None:
        """`admit(ve, admission)`: hand a deferred admission to virtual engine ve's
        scheduler (the engine's; ValueError when the scheduler refuses it)."""
        self.skeleton = skeleton
        self._admit = admit
        num_ve = len(skeleton.schedulers)
        self.in_flight: list[LaunchedStep | None] = [None] * num_ve
        # Per virtual engine: requests added while its batch was in flight, not yet scheduled.
        self.deferred: list[list] = [[] for _ in range(num_ve)]
        self._next_ve = 0

    def defer_admission(self, ve: int, request, admission) -> bool:
        """Keep the admission while ve's batch is in flight (its scheduler takes new requests
        after that batch's update, at its next turn); True when kept."""
        if self.in_flight[ve] is None:
            return False
        self.deferred[ve].append((request, admission))
        return True

    def has_in_flight(self) -> bool:
        return any(s is not None for s in self.in_flight)

    def step(self) -> list[RequestOutput]:
        skeleton = self.skeleton
        touched = skeleton.begin()
        ve = self._next_ve
        self._next_ve = (ve + 1) % len(self.in_flight)
        runner = skeleton.runner
        in_flight, self.in_flight[ve] = self.in_flight[ve], None
        if in_flight is not None:
            skeleton.complete(in_flight, touched,
                              lambda: runner.collect(in_flight.scheduled, in_flight.handle))
        if self.deferred[ve]:
            self._admit_deferred(ve, touched)
        if skeleton.table.per_virtual_engine[ve]:
            self.in_flight[ve] = skeleton.launch(ve, touched, lambda s: runner.submit(
                s.scheduled, s.batch.prompt_logit_rows, s.lora_slots, ve))
        return skeleton.outputs(touched)

    def _admit_deferred(self, ve: int, touched) -> None:
        """Hand virtual engine ve's scheduler the requests added while its batch was in flight
        (those aborted meanwhile are skipped; one the scheduler refuses fails alone --
        admission's capacity check refuses the same ones first, so this does not happen)."""
        deferred, self.deferred[ve] = self.deferred[ve], []
        for request, admission in deferred:
            if request.finished:
                continue
            try:
                self._admit(ve, admission)
            except ValueError as exc:
                self.skeleton.fail_requests(
                    {request.request_id: describe_fault("admission", exc)}, touched)
