"""Asynchronous scheduling: the host schedules and launches step N+1 while the device runs step
N, and reads N's sampled ids back one step late (vLLM's async scheduling, on our scheduler).

One `LLMEngine.step()` with a step N in flight:

  1. schedule N+1. The scheduler was updated for N with placeholder tokens (PLACEHOLDER) right
     after N was launched, so every row of N that sampled already counts its token: N+1
     decodes it. Its input id is on the device: the runner reads it from N's sampled ids
     (model_runner.TokenSource), never from the placeholder.
  2. plan N+1's sampling, launch its forward and sampling (the ids stay on the device:
     KernelSampler's DeferredSample).
  3. collect N: read its ids back (on a GPU, the wait for N's kernels; N+1 is queued behind),
     write them over the placeholders (Scheduler.patch_sampled_tokens: before any later
     update hashes their block), then the engine's own postprocessing (append, detokenize,
     stop checks, outputs) with the scheduler update replaced by `_LateUpdate`: a sequence
     that stopped at N (EOS, a stop id or string -- known only now) is aborted in the
     scheduler, freeing its blocks; its N+1 row, computed for nothing, is skipped when N+1 is
     collected (its request has finished). Length limits the scheduler applies itself at the
     placeholder update, as the engine does at collect (the same counts).
  4. update N+1 with placeholders; N+1 is now in flight. The outputs of N are returned.

Exactness: the tokens and finish reasons are the synchronous engine's (tests/engine/
test_async_scheduling.py, on the sim backend). That needs every running request's next step
to be independent of the token it has not seen yet, so a step runs this way only when no
unfinished request has a repetition / frequency / presence penalty, min_tokens, bad words or
n > 1 (the sampler or the fork would read the missing token or its count), and there is no
speculation, pipelining or tensor parallelism (the engine enables it only then); otherwise
the step in flight is collected and the engine steps synchronously until it is allowed again.
Unseeded random sampling draws from one generator in row order, so its draws differ from a
synchronous run's (as in vLLM); seeded requests draw from their own generators and do not.
On the CPU backends there is no device to overlap with: the engine refuses it there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedrun.runtime.model_runner import TokenSource

# The scheduler's token for a sampled token not yet read back: no vocabulary has it, so a block
# hashed with it by mistake could never match a real prefix.
PLACEHOLDER = -1
MAX_ERROR_CHARS = 500  # RequestOutput.error at most, as engine.py cuts its own messages


@dataclass
class _InFlight:
    """A launched step whose tokens are still on the device."""

    scheduled: object        # its SchedulerOutput (updated with placeholders)
    batch: object            # its SamplingBatch
    failed: dict             # faults of single requests found while planning
    executed: object         # its RunnerOutput (prompt logits are host arrays already)
    sampled: object          # DeferredSample, or a SamplerOutput when logprobs were read
    finished: list           # sequence ids the placeholder update finished (length limit)


class _LateUpdate:
    """The scheduler as `_postprocess` sees it when collecting a step already updated with
    placeholders: update_from_output aborts the sequences that stopped (the scheduler only
    knew their length limit) and returns what the placeholder update finished plus those;
    everything else is the real scheduler's."""

    def __init__(self, scheduler, finished: list) -> None:
        self._scheduler = scheduler
        self._finished = finished
        self.aborted = 0  # sequences whose stop was found here, one step late

    def update_from_output(self, out, token_ids, stop_mask, num_accepted=None,
                           accepted_token_ids=None) -> list:
        del token_ids, num_accepted, accepted_token_ids  # patched already; no speculation
        finished = list(self._finished)
        for row in np.flatnonzero(stop_mask).tolist():
            seq_id = int(out.req_ids[row])
            if self._scheduler.abort_request(seq_id):
                finished.append(seq_id)
                self.aborted += 1
        return finished

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)


def request_allows_async(request) -> bool:
    """Whether a request's next step can be planned before its last token is known."""
    p = request.params
    return (p.n == 1 and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.min_tokens
            and not getattr(p, "_bad_words_token_ids", None) and not getattr(p, "bad_words", None))


class AsyncScheduler:
    """The engine's asynchronous stepping (module docstring); `engine` is the LLMEngine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.in_flight: _InFlight | None = None
        self.steps = 0        # steps launched ahead of their predecessor's tokens
        self.late_stops = 0   # sequences aborted at collect for a stop found one step late

    def allowed(self) -> bool:
        return all(request_allows_async(r) for r in self.engine._requests.values())

    def step(self):
        """One asynchronous iteration, or None: the engine steps synchronously this time
        (nothing in flight and a request that needs it)."""
        eng = self.engine
        if not self.allowed():
            if self.in_flight is None:
                return None
            touched = self._take_pending_final()
            self._collect(touched)  # the step in flight first; synchronous from the next
            return eng._outputs(touched)
        touched = self._take_pending_final()
        scheduler = eng.scheduler
        launched = self._launch(touched) if eng._requests else None
        if self.in_flight is not None:
            self._collect(touched)
        if launched is not None and eng.scheduler is scheduler:
            self._update(launched, touched)
        # (else a fault reset the scheduler while collecting: the launched step's requests
        # were failed with everyone else's, and the fresh scheduler never saw its rows)
        return eng._outputs(touched)

    def _take_pending_final(self) -> dict:
        """The requests aborted since the last step: their final outputs go out now."""
        eng = self.engine
        touched = {r.request_id: r for r in eng._pending_final}
        eng._pending_final = []
        return touched

    # ------------------------------------------------------------------ phases
    def _launch(self, touched) -> _InFlight | None:
        """Schedule, plan and launch the next step; None when it could not be (its requests
        failed and the scheduler's step is closed)."""
        eng = self.engine
        try:
            scheduled = eng.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            self.in_flight = None  # the fresh scheduler knows none of its rows
            eng._reset(exc, touched)
            return None
        failed: dict[str, str] = {}
        try:
            batch = eng._plan_sampling(scheduled, failed)
            lora_slots = eng._lora_slots(scheduled, failed)
            executed = eng.runner.execute(scheduled, batch.prompt_logit_rows,
                                          row_lora_slots=lora_slots,
                                          token_source=self._token_source(scheduled))
            sampled = self._sample(batch, executed, failed)
        except Exception as exc:  # noqa: BLE001 -- belongs to no single request
            eng._fail_step(scheduled, exc, touched)
            return None
        return _InFlight(scheduled, batch, failed, executed, sampled, [])

    def _token_source(self, scheduled) -> TokenSource | None:
        """The rows of `scheduled` whose input token is the step in flight's sampled token:
        a one-token query at the very position that step's placeholder holds."""
        prev = self.in_flight
        if prev is None:
            return None
        out = prev.scheduled
        held = {}  # sequence id -> (placeholder's token index, index into the sampled ids)
        for j, (row, _, _) in enumerate(prev.batch.targets):
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
            self.engine.runner.ops.to_device(prev.sampled.token_ids))
        return TokenSource(np.array(positions, np.int64), ids, np.array(id_rows, np.int64))

    def _sample(self, batch, executed, failed):
        """The step's tokens left on the device (KernelSampler's DeferredSample); when a row
        wants logprobs or the batch fails, the engine's own sampling (read now)."""
        eng = self.engine
        targets = batch.targets
        if failed or not targets:
            return eng._sample(batch, executed, failed)
        try:
            return eng.sampler.sample(
                executed.logits, [t[2].params for t in targets],
                [t[1].generator for t in targets], [t[2].prompt_token_ids for t in targets],
                [t[1].output_token_ids for t in targets], row_index=batch.row_index,
                defer_read=True)
        except Exception:  # noqa: BLE001 -- find the request at fault, as a synchronous step
            return eng._sample(batch, executed, failed)

    def _collect(self, touched) -> None:
        """Read the step in flight's tokens, write them over its placeholders, postprocess."""
        eng = self.engine
        prev, self.in_flight = self.in_flight, None
        try:
            sampled = prev.sampled.read() if hasattr(prev.sampled, "read") else prev.sampled
            out = prev.scheduled
            row_tokens = np.full(out.num_reqs, PLACEHOLDER, np.int32)
            for j, (row, _, _) in enumerate(prev.batch.targets):
                row_tokens[row] = sampled.token_ids[j]
            eng.scheduler.patch_sampled_tokens(out, row_tokens)
        except Exception as exc:  # noqa: BLE001 -- the device or the read failed: the step
            self._fail_collected(prev, exc, touched)
            return
        real = eng.scheduler
        late = _LateUpdate(real, prev.finished)
        eng.scheduler = late
        try:
            eng._postprocess(out, prev.batch, prev.executed, sampled, prev.failed, touched)
        finally:
            if eng.scheduler is late:  # (_postprocess may have reset it)
                eng.scheduler = real
        self.late_stops += late.aborted
        eng._num_failed_steps = 0

    def _fail_collected(self, prev: _InFlight, exc: BaseException, touched) -> None:
        """A step in flight whose tokens cannot be read: every request it ran fails (their
        blocks return now; the scheduler's update for it happened at launch)."""
        eng = self.engine
        try:
            message = f"step failed: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        except Exception:  # noqa: BLE001 -- an exception whose str() raises
            message = f"step failed: {type(exc).__name__}"
        seq_ids = [int(i) for i in prev.scheduled.req_ids]
        eng._fail_requests({eng._seqs[i][0].request_id: message for i in seq_ids
                            if i in eng._seqs}, touched)
        eng._num_failed_steps += 1

    def _update(self, launched: _InFlight, touched) -> None:
        """The scheduler's update of a launched step, every sampled token a placeholder."""
        eng = self.engine
        out = launched.scheduled
        try:
            launched.finished = eng.scheduler.update_from_output(
                out, np.full(out.num_reqs, PLACEHOLDER, np.int32), None)
        except Exception as exc:  # noqa: BLE001 -- the scheduler's state is unknown now
            eng._reset(exc, touched)
            return
        self.in_flight = launched
        self.steps += 1
