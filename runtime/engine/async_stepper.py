"""Asynchronous scheduling: the host schedules and launches step N+1 while the device runs step
N, and reads N's sampled ids back one step late (vLLM's async scheduling, on our scheduler).

One `LLMEngine.step()` with a step N in flight (AsyncStepper.step):

  1. schedule N+1. The scheduler was updated for N with placeholder tokens (PLACEHOLDER) right
     after N was launched, so every row of N that sampled already counts its token: N+1
     decodes it. Its input id is on the device: the runner reads it from N's sampled ids
     (model_runner.TokenSource), never from the placeholder.
  2. plan N+1's sampling, launch its forward and sampling (the ids stay on the device:
     KernelSampler's DeferredSample).
  3. collect N: read its ids back (on a GPU, the wait for N's kernels; N+1 is queued behind),
     write them over the placeholders (Scheduler.patch_sampled_tokens: before any later
     update hashes their block), then the engine's own postprocessing (append, detokenize,
     stop checks, outputs) with the scheduler update replaced by `LateUpdate`: a sequence
     that stopped at N (EOS, a stop id or string -- known only now) is aborted in the
     scheduler, freeing its blocks; its N+1 row, computed for nothing, is skipped when N+1 is
     collected (its request has finished). Length limits the scheduler applies itself at the
     placeholder update, as the engine does at collect (the same counts).
  4. update N+1 with placeholders; N+1 is now in flight. The outputs of N are returned.

Exactness: the tokens and finish reasons are the synchronous engine's
(tests/engine/test_async_scheduling.py, on the sim backend). That needs every running request's
next step to be independent of the token it has not seen yet, so a step runs this way only when no
unfinished request has a repetition / frequency / presence penalty, min_tokens, bad words or
n > 1 (the sampler or the fork would read the missing token or its count), and there is no
speculation, pipelining or tensor parallelism (the engine enables it only then); otherwise
the step in flight is collected and the engine steps synchronously (SyncStepper) until it is
allowed again.
Unseeded random sampling draws from one generator in row order, so its draws differ from a
synchronous run's (as in vLLM); seeded requests draw from their own generators and do not.
On the CPU backends there is no device to overlap with: the engine refuses it there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.errors import describe_fault
from pagedrun.runtime.model_runner import TokenSource
from pagedrun.runtime.outputs import RequestOutput

from .sampling_plan import sample
from .step import LaunchedStep, StepSkeleton
from .steppers import SyncStepper

# The scheduler's token for a sampled token not yet read back: no vocabulary has it, so a block
# hashed with it by mistake could never match a real prefix.
PLACEHOLDER = -1


@dataclass
class _InFlight:
    """A launched step whose tokens are still on the device."""

    step: LaunchedStep       # step.scheduled is updated with placeholders
    executed: object         # its RunnerOutput (prompt logits are host arrays already)
    sampled: object          # DeferredSample, or a SamplerOutput when logprobs were read
    finished: list           # sequence ids the placeholder update finished (length limit)


class LateUpdate:
    """The scheduler update of a step already updated with placeholders, as the skeleton's
    postprocess calls it: the sequences that stopped are aborted (the scheduler only knew their
    length limit), and what the placeholder update finished is returned with them."""

    def __init__(self, scheduler, finished: list) -> None:
        self._scheduler = scheduler
        self._finished = finished
        self.aborted = 0  # sequences whose stop was found here, one step late

    def __call__(self, out, token_ids, stop_mask, num_accepted=None,
                 accepted_token_ids=None) -> list:
        del token_ids, num_accepted, accepted_token_ids  # patched already; no speculation
        finished = list(self._finished)
        for row in np.flatnonzero(stop_mask).tolist():
            seq_id = int(out.req_ids[row])
            if self._scheduler.abort_request(seq_id):
                finished.append(seq_id)
                self.aborted += 1
        return finished


def request_allows_async(request) -> bool:
    """Whether a request's next step can be planned before its last token is known."""
    p = request.params
    return (p.n == 1 and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.min_tokens
            and not getattr(p, "_bad_words_token_ids", None) and not getattr(p, "bad_words", None))


class AsyncStepper:
    """The engine's asynchronous stepping (module docstring), on virtual engine 0."""

    def __init__(self, skeleton: StepSkeleton, to_device) -> None:
        """`to_device(host_ids)`: the backend's upload, for sampled ids read on the host."""
        self.skeleton = skeleton
        self.sync = SyncStepper(skeleton)
        self._to_device = to_device
        self.in_flight: _InFlight | None = None
        self.steps = 0        # steps launched ahead of their predecessor's tokens
        self.late_stops = 0   # sequences aborted at collect for a stop found one step late

    def allowed(self) -> bool:
        return all(request_allows_async(r) for r in self.skeleton.table.requests.values())

    def has_in_flight(self) -> bool:
        return self.in_flight is not None

    def defer_admission(self, ve: int, request, admission) -> bool:
        """Never: a new request joins the scheduler at once and the next launch schedules it
        (the step in flight was scheduled before it)."""
        return False

    def step(self) -> list[RequestOutput]:
        """One asynchronous iteration; a synchronous one when a request needs it (after the
        step in flight, if any, is collected alone)."""
        skeleton = self.skeleton
        if not self.allowed():
            if self.in_flight is None:
                return self.sync.step()
            touched = skeleton.begin()
            self._collect(touched)  # the step in flight first; synchronous from the next
            return skeleton.outputs(touched)
        touched = skeleton.begin()
        scheduler = skeleton.schedulers[0]
        launched = self._launch(touched) if skeleton.table.requests else None
        if self.in_flight is not None:
            self._collect(touched)
        if launched is not None and skeleton.schedulers[0] is scheduler:
            self._update(launched, touched)
        # (else a fault reset the scheduler while collecting: the launched step's requests
        # were failed with everyone else's, and the fresh scheduler never saw its rows)
        return skeleton.outputs(touched)

    # ------------------------------------------------------------------ phases
    def _launch(self, touched) -> _InFlight | None:
        """Schedule, plan and launch the next step; None when it could not be (its requests
        failed and the scheduler's step is closed, or the scheduler was reset)."""
        skeleton = self.skeleton
        before = skeleton.schedulers[0]
        results = {}

        def run(step: LaunchedStep):
            executed = skeleton.runner.execute(step.scheduled, step.batch.prompt_logit_rows,
                                               row_lora_slots=step.lora_slots,
                                               token_source=self._token_source(step.scheduled))
            results["executed"] = executed
            results["sampled"] = self._sample(step, executed)
            return executed

        step = skeleton.launch(0, touched, run)
        if step is None:
            if skeleton.schedulers[0] is not before:
                self.in_flight = None  # the fresh scheduler knows none of its rows
            return None
        return _InFlight(step, results["executed"], results["sampled"], [])

    def _token_source(self, scheduled) -> TokenSource | None:
        """The rows of `scheduled` whose input token is the step in flight's sampled token:
        a one-token query at the very position that step's placeholder holds."""
        prev = self.in_flight
        if prev is None:
            return None
        out = prev.step.scheduled
        held = {}  # sequence id -> (placeholder's token index, index into the sampled ids)
        for j, (row, _, _) in enumerate(prev.step.batch.targets):
            held[int(out.req_ids[row])] = (int(out.context_lens[row]), j)
        positions, id_rows = [], []
        qsl, computed = scheduled.query_start_loc, scheduled.num_computed_tokens_before
        for row, (seq_id, qlen) in enumerate(zip(scheduled.req_ids.tolist(),
                                                 scheduled.query_lens.tolist())):
            hit = held.get(seq_id)
            if hit is not None and qlen == 1 and int(computed[row]) == hit[0]:
                positions.append(int(qsl[row]))
                id_rows.append(hit[1])
        inputs = scheduled.input_token_ids
        if (inputs < 0).any():
            # A placeholder with no sampled id to read (its request failed while planning and
            # ends at collect): token 0 keeps the embedding in bounds; the row's result is
            # never used.
            inputs[inputs < 0] = 0
        if not positions:
            return None
        ids = prev.sampled.device if hasattr(prev.sampled, "device") else (
            self._to_device(prev.sampled.token_ids))
        return TokenSource(np.array(positions, np.int64), ids, np.array(id_rows, np.int64))

    def _sample(self, step: LaunchedStep, executed):
        """The step's tokens left on the device (KernelSampler's DeferredSample); when a row
        wants logprobs or the batch fails, the skeleton's own sampling (read now)."""
        sampler, batch, failed = self.skeleton.sampler, step.batch, step.failed
        if failed or not batch.targets:
            return sample(sampler, batch, executed.logits, failed)
        params, generators, prompts, outputs, row_index = batch.sampler_args()
        try:
            return sampler.sample(executed.logits, params, generators, prompts, outputs,
                                  row_index=row_index, defer_read=True)
        except Exception:  # noqa: BLE001 -- find the request at fault, as a synchronous step
            return sample(sampler, batch, executed.logits, failed)

    def _collect(self, touched) -> None:
        """Read the step in flight's tokens, write them over its placeholders, postprocess."""
        skeleton = self.skeleton
        prev, self.in_flight = self.in_flight, None
        step = prev.step
        scheduler = skeleton.schedulers[0]
        try:
            sampled = prev.sampled.read() if hasattr(prev.sampled, "read") else prev.sampled
            out = step.scheduled
            row_tokens = np.full(out.num_reqs, PLACEHOLDER, np.int32)
            for j, (row, _, _) in enumerate(step.batch.targets):
                row_tokens[row] = sampled.token_ids[j]
            scheduler.patch_sampled_tokens(out, row_tokens)
        except Exception as exc:  # noqa: BLE001 -- the device or the read failed: the step
            self._fail_collected(prev, exc, touched)
            return
        late = LateUpdate(scheduler, prev.finished)
        skeleton.postprocess(0, out, step.batch, prev.executed, sampled, step.failed, touched,
                             update=late)
        self.late_stops += late.aborted
        skeleton.num_failed_steps = 0

    def _fail_collected(self, prev: _InFlight, exc: BaseException, touched) -> None:
        """A step in flight whose tokens cannot be read: every request it ran fails (their
        blocks return now; the scheduler's update for it happened at launch)."""
        skeleton = self.skeleton
        message = describe_fault("step", exc)
        seqs = skeleton.table.seqs
        seq_ids = [int(i) for i in prev.step.scheduled.req_ids]
        skeleton.fail_requests({seqs[i][0].request_id: message for i in seq_ids if i in seqs},
                               touched)
        skeleton.num_failed_steps += 1

    def _update(self, launched: _InFlight, touched) -> None:
        """The scheduler's update of a launched step, every sampled token a placeholder."""
        skeleton = self.skeleton
        out = launched.step.scheduled
        try:
            launched.finished = skeleton.schedulers[0].update_from_output(
                out, np.full(out.num_reqs, PLACEHOLDER, np.int32), None)
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            skeleton.reset(0, exc, touched)
            return
        self.in_flight = launched
        self.steps += 1
