"""StepPhases: each engine step's host time split into phases, by perf_counter_ns wrappers
installed on the engine's existing methods (runtime/ is not modified; `uninstall` undoes all).

Timers (inclusive nanoseconds per step) and where they sit in LLMEngine.step:

    step              LLMEngine.step, the whole call
    schedule          scheduler.schedule()                      (a proxy around the scheduler)
    plan_sampling     runtime/engine/sampling_plan.plan_sampling (as the step skeleton calls it)
    execute           runner.execute: block moves, attention metadata, step_inputs, the forward
    forward, logits   runner.model.forward / runner.model.logits: every op call (launch); with
                      decode graphs, runner.decode_graphs.run (inputs filled, one replay)
    sample            runtime/engine/sampling_plan.sample (as the step skeleton calls it)
    postprocess       StepSkeleton.postprocess
    append            OutputProcessor.append_sampled: every token appended and stop-checked (once
                      per step; append_token, with detokenization and stop strings, inside it)
    detokenize        IncrementalDetokenizer.add_token (patched on the class while installed)
    scheduler_update  scheduler.update_from_output
    outputs           StepSkeleton.outputs: the RequestOutput objects

`phases(raw)` turns them into the exclusive phases the benchmark reports (PHASES). Each
wrapper costs a few hundred nanoseconds (`wrapper_overhead_ns` measures it); detokenize runs
once per token it decodes (only with stop strings inside a step), so its wrapper adds that much
per sequence to postprocess.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable

from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.engine import step as engine_step

# Exclusive phases, in step order; "postprocess" is the sum of the four after it plus the rest
# of StepSkeleton.postprocess (forks, finished requests); "other" is the step's time outside
# every timer.
PHASES = ("schedule", "input_prep", "launches", "sampling", "postprocess", "detokenize",
          "stop_checks", "scheduler_update", "output_objects", "other", "total")


def phases(raw: dict[str, int]) -> dict[str, int]:
    """Exclusive phase nanoseconds of one step from its inclusive timers."""
    g = raw.get
    launches = g("forward", 0) + g("logits", 0)
    postprocess = g("postprocess", 0) + g("outputs", 0)
    timed = (g("schedule", 0) + g("plan_sampling", 0) + g("execute", 0) + g("sample", 0)
             + postprocess)
    return {
        "schedule": g("schedule", 0),
        "input_prep": g("plan_sampling", 0) + g("execute", 0) - launches,
        "launches": launches,
        "sampling": g("sample", 0),
        "postprocess": postprocess,
        "detokenize": g("detokenize", 0),
        "stop_checks": g("append", 0) - g("detokenize", 0),
        "scheduler_update": g("scheduler_update", 0),
        "output_objects": g("outputs", 0),
        "other": g("step", 0) - timed,
        "total": g("step", 0),
    }


class _TimedScheduler:
    """The engine's scheduler with schedule / update_from_output timed; the rest delegated.
    `last_output`: the SchedulerOutput of the latest schedule()."""

    def __init__(self, inner, timers: dict[str, int]) -> None:
        self._inner = inner
        self._timers = timers
        self.last_output = None

    def schedule(self):
        start = time.perf_counter_ns()
        out = self._inner.schedule()
        self._timers["schedule"] += time.perf_counter_ns() - start
        self.last_output = out
        return out

    def update_from_output(self, *args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return self._inner.update_from_output(*args, **kwargs)
        finally:
            self._timers["scheduler_update"] += time.perf_counter_ns() - start

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _timed(fn: Callable, timers: dict[str, int], key: str) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter_ns() - start
    return timed


class StepPhases:
    """Installs the timers on `engine`; `steps` gets one record per engine.step():
    {"raw": inclusive timers, "num_reqs", "num_batched_tokens", **on_step_end()}."""

    def __init__(self, engine, on_step_end: Callable[[], dict] = dict) -> None:
        self.engine = engine
        self.on_step_end = on_step_end
        self.timers: dict[str, int] = defaultdict(int)
        self.steps: list[dict] = []
        self._undo: list[Callable[[], None]] = []

    def install(self) -> "StepPhases":
        engine, timers = self.engine, self.timers
        schedulers = engine.schedulers
        inner_scheduler = schedulers[0]
        self._scheduler = _TimedScheduler(inner_scheduler, timers)
        schedulers[0] = self._scheduler
        self._undo.append(lambda: schedulers.__setitem__(0, inner_scheduler))
        for name, key in (("plan_sampling", "plan_sampling"), ("sample", "sample")):
            self._patch_module(engine_step, name, key)
        self._patch_instance(engine.skeleton, "postprocess", "postprocess")
        self._patch_instance(engine.skeleton, "outputs", "outputs")
        self._patch_instance(engine.output_processor, "append_sampled", "append")
        self._patch_instance(engine.runner, "execute", "execute")
        self._patch_instance(engine.runner.model, "forward", "forward")
        self._patch_instance(engine.runner.model, "logits", "logits")
        if getattr(engine.runner, "decode_graphs", None) is not None:
            # A decode step replaying a graph: its host work (fill and upload the static
            # inputs, the replay) is the step's "launches".
            self._patch_instance(engine.runner.decode_graphs, "run", "forward")
        add_token = IncrementalDetokenizer.add_token  # every sequence's detokenizer
        IncrementalDetokenizer.add_token = _timed(add_token, timers, "detokenize")
        self._undo.append(lambda: setattr(IncrementalDetokenizer, "add_token", add_token))
        step = engine.step
        engine.step = self._timed_step(step)
        self._undo.append(lambda: delattr(engine, "step"))
        return self

    def _patch_module(self, module, name: str, key: str) -> None:
        original = getattr(module, name)
        setattr(module, name, _timed(original, self.timers, key))
        self._undo.append(lambda: setattr(module, name, original))

    def _patch_instance(self, obj, name: str, key: str) -> None:
        setattr(obj, name, _timed(getattr(obj, name), self.timers, key))
        self._undo.append(lambda: delattr(obj, name))

    def _timed_step(self, step: Callable) -> Callable:
        def timed_step():
            self.timers.clear()
            self._scheduler.last_output = None
            start = time.perf_counter_ns()
            outputs = step()
            self.timers["step"] = time.perf_counter_ns() - start
            out = self._scheduler.last_output
            self.steps.append({
                "raw": dict(self.timers),
                "num_reqs": 0 if out is None else int(out.num_reqs),
                "num_batched_tokens": 0 if out is None else int(out.num_batched_tokens),
                **self.on_step_end()})
            return outputs
        return timed_step

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


def wrapper_overhead_ns(calls: int = 20000) -> float:
    """Median nanoseconds one _timed wrapper adds to a call (three runs of `calls` calls)."""
    def noop():
        return None

    timers: dict[str, int] = defaultdict(int)
    wrapped = _timed(noop, timers, "noop")
    samples = []
    for _ in range(3):
        start = time.perf_counter_ns()
        for _ in range(calls):
            noop()
        bare = time.perf_counter_ns() - start
        start = time.perf_counter_ns()
        for _ in range(calls):
            wrapped()
        samples.append((time.perf_counter_ns() - start - bare) / calls)
    return statistics.median(samples)
