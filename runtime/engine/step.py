"""StepSkeleton: the one fault-contained step -- schedule, plan, run, complete -- that every
stepper (runtime/engine/steppers.py, async_stepper.py) drives.

    touched = skeleton.begin()                       # the requests aborted since last step
    step = skeleton.launch(ve, touched, run)         # schedule -> plan -> run(...) -> handle
    skeleton.complete(step, touched, logits)         # logits() -> sample -> verify -> postprocess
    return skeleton.outputs(touched)

A stepper says only *when* the phases run and what `run` / `logits` are (the runner's execute,
or submit and collect of a pipelined batch); the skeleton owns what each phase does and how a
fault is contained (docs/engine_api.md, "Failures"):
- one request's fault (its sampling, logprobs, detokenization, stop checks, fork) fails that
  request alone -- finish_reason "error", RequestOutput.error set, its blocks freed -- and the
  rest of the batch goes on;
- a fault that belongs to no request (the forward, a kernel) fails the step's requests and
  closes the scheduler's step cleanly (`fail_step`); after MAX_CONSECUTIVE_STEP_FAILURES such
  steps in a row, or an exception that says `engine_dead` (a lost rank), EngineDeadError;
- a scheduler fault leaves its state unknown: every request of that virtual engine fails and a
  fresh scheduler takes its place (`reset`; the runner and its KV memory are kept).
Every method takes the virtual engine `ve` it works on (pipeline parallelism runs one
scheduler per stage in flight); nothing depends on a hidden "current" one.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.errors import PagedRunError, describe_fault
from pagedrun.runtime.outputs import RequestOutput
from pagedrun.runtime.request import Request
from pagedrun.runtime.spec_decode.spec_step import SpecDecodeStep, VerifiedRows
from pagedrun.runtime.stop_checker import FINISH_ERROR, FINISH_LENGTH

from .output_processor import OutputProcessor
from .request_table import RequestTable
from .sampling_plan import SamplingBatch, plan_sampling, sample

log = logging.getLogger("pagedrun.engine")

# Steps in a row that fail outside any one request before the engine calls itself dead (a
# broken device fails every step: better an exit with every client answered than a server
# that accepts work it can never do).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(PagedRunError):
    """The engine cannot be trusted with another step (a lost rank, a device that fails every
    step): its caller fails every request still in flight and stops (the server exits 1)."""

    engine_dead = True


@dataclass
class LaunchedStep:
    """A step between its launch and its completion: what completing it needs."""

    ve: int                    # its virtual engine
    scheduled: object          # its SchedulerOutput
    batch: SamplingBatch
    failed: dict[str, str]     # faults of single requests found while planning
    lora_slots: object         # per row adapter slot, or None
    handle: object = None      # what `run` returned (a RunnerOutput, or a pipelined handle)
    draft_weights: dict | None = None  # the draft model's q per speculating row


# update(out, token_ids, stop_mask, num_accepted, accepted) -> finished sequence ids: the
# scheduler's update_from_output, or the async stepper's late update.
SchedulerUpdate = Callable[..., list]


class StepSkeleton:
    def __init__(self, schedulers: list, table: RequestTable, runner, sampler,
                 outputs: OutputProcessor, *, spec: SpecDecodeStep | None = None,
                 lora=None, new_scheduler: Callable) -> None:
        """`schedulers`: one per virtual engine (a reset replaces an entry in place);
        `lora`: LoRAPins or None; `new_scheduler(config)`: a fresh scheduler for `reset`."""
        self.schedulers = schedulers
        self.table = table
        self.runner = runner
        self.sampler = sampler
        self.outputs_of = outputs
        self.spec = spec
        self.lora = lora
        self._new_scheduler = new_scheduler
        self.num_failed_steps = 0  # in a row, outside any one request

    # ------------------------------------------------------------------ the phases
    def begin(self) -> dict[str, Request]:
        """A step's `touched` map, seeded with the requests aborted since the last step."""
        return self.table.take_pending_final()

    def launch(self, ve: int, touched: dict[str, Request],
               run: Callable[[LaunchedStep], object], *,
               with_draft: bool = False) -> LaunchedStep | None:
        """Propose drafts, schedule, plan the sampling and adapters, then `run(step)` (its
        result becomes step.handle). None when nothing could be launched: the scheduler failed
        and was reset, or the step's requests failed and its scheduler step is closed.
        `with_draft`: run the draft model's part after scheduling (speculative decoding with a
        draft model, synchronous steps)."""
        scheduler = self.schedulers[ve]
        if self.spec is not None:
            self.spec.propose(scheduler)
        try:
            scheduled = scheduler.schedule()                          # SchedulerOutput
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            self.reset(ve, exc, touched)
            return None
        failed: dict[str, str] = {}  # request id -> why, for faults of one request
        try:
            draft_weights = (self.spec.run_draft(scheduled)
                             if with_draft and self.spec is not None else None)
            batch = plan_sampling(scheduled, self.table, failed,
                                  self.outputs_of.wants_prompt_logits)
            lora_slots = (self.lora.step_slots(scheduled, failed, self.request_id_of)
                          if self.lora is not None else None)
            step = LaunchedStep(ve, scheduled, batch, failed, lora_slots,
                                draft_weights=draft_weights)
            step.handle = run(step)
        except Exception as exc:  # noqa: BLE001 -- belongs to no single request
            self.fail_step(ve, scheduled, exc, touched)
            return None
        return step

    def complete(self, step: LaunchedStep, touched: dict[str, Request],
                 logits: Callable[[], object]) -> None:
        """The step's logits (`logits()`: the launched RunnerOutput, or a pipelined batch's
        collect), sampling, verification of drafts, then postprocessing; a failure of any but
        the last belongs to no single request and fails the step."""
        batch, failed = step.batch, step.failed
        try:
            executed = logits()                                              # RunnerOutput
            sampled = sample(self.sampler, batch, executed.logits, failed)   # SamplerOutput
            verified = (self.spec.verify(batch.spec, executed.logits, failed,
                                         step.draft_weights)
                        if self.spec is not None else VerifiedRows())
        except Exception as exc:  # noqa: BLE001 -- belongs to no single request
            self.fail_step(step.ve, step.scheduled, exc, touched)
        else:
            self.postprocess(step.ve, step.scheduled, batch, executed, sampled, failed, touched,
                             verified)
            self.num_failed_steps = 0

    def outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        return self.outputs_of.outputs(touched)

    def request_id_of(self, seq_id: int) -> str:
        return self.table.seqs[seq_id][0].request_id

    # ------------------------------------------------------------------ postprocessing
    def postprocess(self, ve: int, out, batch: SamplingBatch, executed, sampled,
                    failed: dict[str, str], touched: dict[str, Request],
                    verified: VerifiedRows | None = None,
                    update: SchedulerUpdate | None = None) -> None:
        """Prompt logprobs; append, detokenize and stop-check every new token; fail the
        requests at fault; tell the scheduler (`update`, by default its update_from_output:
        finished blocks are freed at once); fork the siblings of n > 1 requests; finish the
        requests whose every sequence has finished."""
        processor = self.outputs_of
        scheduler = self.schedulers[ve]
        processor.prompt_logprobs_of(out, executed.prompt_logits, failed)
        ended, stopped, complete, emitted = processor.append_sampled(batch, sampled, verified,
                                                                     failed, touched)
        self.fail_requests(failed, touched)  # aborted now: the update skips their rows
        num_reqs = out.num_reqs
        if complete and not batch.forks and not batch.spec and len(batch.targets) == num_reqs:
            # Every row sampled one token for its own sequence, in row order: the sampler's
            # tokens are the rows' tokens and only the rows that ended stop.
            token_ids = sampled.token_ids
            stop_mask = np.zeros(num_reqs, dtype=bool)
            stop_mask[stopped] = True
        else:
            token_ids, stop_mask = processor.scheduler_rows(out.req_ids, batch)
        num_accepted, accepted = None, []
        if batch.spec:
            num_accepted = np.zeros(num_reqs, dtype=np.int32)
            for spec, tokens in zip(batch.spec, emitted):
                if not tokens:
                    continue  # failed before its first token: the scheduler skips the row
                token_ids[spec.row] = tokens[-1]
                num_accepted[spec.row] = len(tokens) - 1
                accepted += tokens[:-1]
                stop_mask[spec.row] = spec.seq.finished
        try:
            finished_ids = (update or scheduler.update_from_output)(
                out, token_ids, stop_mask, num_accepted,
                np.array(accepted, dtype=np.int32) if accepted else None)
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            self.reset(ve, exc, touched)
            return
        self._fork(scheduler, batch, touched)
        seqs = self.table.seqs
        for seq_id in finished_ids:
            entry = seqs.get(int(seq_id))
            if entry is not None and not entry[1].finished:
                # The scheduler's length limit fired where ours did not; both count the same
                # tokens, so this is a defect, but the request must still end cleanly.
                log.error("scheduler finished sequence %d before the engine did", seq_id)
                entry[1].finish_reason = FINISH_LENGTH
                ended[entry[0].request_id] = entry[0]
        # Only a request with a sequence that ended in this step can have just finished (the
        # others' last sequence ended earlier, when it finished, or never did).
        for request in ended.values():
            if not request.finished and all(s.finished for s in request.seqs) and (
                    len(request.seqs) == request.params.n):
                self.table.finish(request)

    def _fork(self, scheduler, batch: SamplingBatch, touched: dict[str, Request]) -> None:
        """The siblings of each n > 1 request expanded this step join the scheduler on their
        parent's blocks (copy-on-write); a fork's fault fails its request alone."""
        for parent, siblings in batch.forks:
            request = self.table.seqs.get(parent.seq_id, (None,))[0]
            if request is None or request.finished:
                continue
            try:
                for sib in siblings:
                    if not sib.finished:
                        scheduler.fork_request(parent.seq_id, sib.seq_id,
                                               sib.output_token_ids[-1])
                if parent.finished and any(not s.finished for s in siblings):
                    scheduler.abort_request(parent.seq_id)  # kept only to fork from
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                self.fail_requests({request.request_id: describe_fault("forking", exc)},
                                   touched)

    # ------------------------------------------------------------------ failures
    def fail_requests(self, failed: dict[str, str], touched: dict[str, Request]) -> None:
        """End each request in `failed` with finish_reason "error" and its message; every
        block it holds returns to the pool now (the scheduler skips its rows from here on)."""
        requests = self.table.requests
        for request_id, message in failed.items():
            request = requests.get(request_id)
            if request is None or request.finished:
                continue
            log.error("request %s failed: %s", request_id, message)
            scheduler = self.schedulers[request.virtual_engine]
            for seq in request.seqs:
                scheduler.abort_request(seq.seq_id)  # False for unforked siblings: fine
                if not seq.finished:
                    seq.finish_reason = FINISH_ERROR
            request.error = message
            self.table.finish(request)
            touched[request_id] = request

    def fail_step(self, ve: int, out, exc: BaseException, touched: dict[str, Request]) -> None:
        """A step failed outside any one request (the forward, a kernel, memory): fail every
        request it scheduled -- and those it swapped out, whose host copy may not have been
        written -- then close the step in the scheduler with no row left to advance."""
        message = describe_fault("step", exc)
        log.error("engine step failed: %s", message, exc_info=exc)
        seq_ids = [int(i) for i in out.req_ids]
        if len(out.swap_out):
            seq_ids += [int(i) for i in out.preempted_ids]
        seqs = self.table.seqs
        self.fail_requests({seqs[i][0].request_id: message for i in seq_ids if i in seqs},
                           touched)
        try:  # every row is aborted: this only ends the scheduler's step
            self.schedulers[ve].update_from_output(out, np.zeros(out.num_reqs, np.int32),
                                                   np.ones(out.num_reqs, bool))
        except Exception as reset_exc:  # noqa: BLE001
            self.reset(ve, reset_exc, touched)
        self.count_failed_step(exc, message)

    def count_failed_step(self, exc: BaseException, message: str) -> None:
        """One more step failed outside any request: raise if the engine is dead."""
        self.num_failed_steps += 1
        if getattr(exc, "engine_dead", False):
            raise exc
        if self.num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self.num_failed_steps} steps in a row failed; last: "
                                  f"{message}") from exc

    def reset(self, ve: int, exc: BaseException, touched: dict[str, Request]) -> None:
        """Virtual engine ve's scheduler failed: fail every live request of it and start a
        fresh scheduler (empty pool and prefix cache; the runner and its KV memory are kept)."""
        message = describe_fault("scheduler", exc)
        log.error("engine reset: %s", message, exc_info=exc)
        self.schedulers[ve] = self._new_scheduler(self.schedulers[ve].config)
        requests = self.table.requests
        failed = [rid for rid, r in list(requests.items()) if r.virtual_engine == ve]
        for request_id in failed:  # the new scheduler knows none of their sequences
            request = requests[request_id]
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish_reason = FINISH_ERROR
            request.error = message
            self.table.finish(request)
            touched[request_id] = request
