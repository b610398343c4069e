"""SpecDecodeStep: speculative decoding as a component of the engine's step.

The engine's step calls it at three points (runtime/engine/step.py) and nowhere else:
  - `propose(scheduler)` before schedule(): drafts for the running decodes, as many as each may
    verify (`max_draft`); a proposer failure costs the step its drafts only;
  - `run_draft(out)` after schedule(), with a draft model: its KV for every scheduled token and
    the drafts written into the step;
  - `verify(rows, logits, failed)` after the forward: the emitted tokens of each row that
    verified drafts (runtime/spec_decode/speculator.py has the algorithm). If the batch fails,
    each request's rows are verified alone, so only the request at fault fails.
Rows and their requests come from SpecRow (speculator.py); `seqs` is the engine's sequence
table (seq id -> (request, sequence)), read only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pagedrun.runtime.errors import describe_fault

from .speculator import Speculator, SpecRow

log = logging.getLogger("pagedrun.engine")


@dataclass
class VerifiedRows:
    """The rejection sampler's result for a step's spec rows: per row, the emitted tokens
    (accepted drafts, then the final token) and their logprobs entries (None: not asked for,
    or the row failed: then no tokens)."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list | None] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)  # before any stop cut the row short


class SpecDecodeStep:
    def __init__(self, speculator: Speculator, seqs: Mapping, *, logprobs_mode: str,
                 max_model_len: int, generator, to_host: Callable) -> None:
        """`generator`: the engine sampler's (unseeded draws); `to_host(rows)`: a logits
        slice as a host array (a copy off the device on kernel backends)."""
        self.speculator = speculator
        self._seqs = seqs
        self._logprobs_mode = logprobs_mode
        self._max_model_len = max_model_len
        self._generator = generator
        self._to_host = to_host

    @property
    def draft(self):
        return self.speculator.draft

    @property
    def stats(self):
        return self.speculator.stats

    def propose(self, scheduler) -> None:
        """Drafts for the next schedule(); a proposer failure costs this step its drafts only."""
        try:
            self.speculator.propose(scheduler, self.max_draft)
        except Exception as exc:  # noqa: BLE001 -- belongs to no request: plain decoding
            log.error("speculative proposal failed, decoding without drafts: %s",
                      describe_fault("proposing", exc), exc_info=exc)

    def max_draft(self, seq_id: int) -> int:
        """How many drafts this sequence may verify in one step: what it may still emit
        after the step's final token; none when its logprobs are asked in a processed mode
        (the verification weights are not those values), when its next sample is an n > 1
        request's first (which forks the siblings) or when it is unknown (finished)."""
        entry = self._seqs.get(seq_id)
        if entry is None:
            return 0
        request, seq = entry
        params = request.params
        if params.n > 1 and not request.forked:
            return 0  # its first sample forks the siblings: a plain row
        if params.logprobs is not None and not self._logprobs_mode.startswith("raw"):
            return 0
        max_new = params.max_tokens if params.max_tokens is not None else self._max_model_len
        return max_new - len(seq.output_token_ids) - 1

    def run_draft(self, out) -> dict[int, np.ndarray] | None:
        """The draft model's part of the step (draft_model.py): its KV for every scheduled
        token, and the drafts of the speculating rows written into `out`. Returns batch row ->
        the draft's weights q of its drafts; None without a draft model."""
        if self.speculator.draft is None:
            return None
        histories = {}
        for row in np.flatnonzero(out.num_draft_tokens).tolist():
            request, seq = self._seqs[int(out.req_ids[row])]
            histories[row] = (request.params, request.prompt_token_ids, seq.output_token_ids,
                              seq.generator)
        return self.speculator.draft.run(out, histories, self._generator)

    def verify(self, rows: list[SpecRow], logits, failed: dict[str, str],
               draft_weights: dict[int, np.ndarray] | None = None) -> VerifiedRows:
        """The spec rows' emitted tokens, `logits` the step's (RunnerOutput.logits)."""
        verified = VerifiedRows([[] for _ in rows], [None] * len(rows), [0] * len(rows))
        if not rows:
            return verified
        # Host rows of every spec row's positions, in batch order.
        index = np.concatenate([np.arange(r.logits_start, r.logits_start + r.draft_token_ids.size
                                          + 1) for r in rows])
        host = np.asarray(self._to_host(logits[index]), dtype=np.float32)
        offsets = np.concatenate(([0], np.cumsum([r.draft_token_ids.size + 1 for r in rows])))
        groups = {None: list(range(len(rows)))}  # one batch first; per request if it fails
        while groups:
            retry: dict[str, list[int]] = {}
            for request_id, own in groups.items():
                own = [j for j in own if rows[j].request.request_id not in failed]
                if not own:
                    continue
                try:
                    part = self.speculator.verify(
                        np.concatenate([host[offsets[j]:offsets[j + 1]] for j in own]),
                        [rows[j] for j in own], self._generator, draft_weights)
                    for b, j in enumerate(own):
                        tokens = part.emitted(b).tolist()
                        verified.tokens[j] = tokens
                        verified.num_accepted[j] = len(tokens) - 1
                        num_top = rows[j].request.params.logprobs
                        if num_top is not None:
                            verified.logprobs[j] = [
                                self.speculator.logprobs(host[offsets[j] + i], t, num_top)
                                for i, t in enumerate(tokens)]
                except Exception as exc:  # noqa: BLE001
                    if request_id is None:
                        for j in own:
                            retry.setdefault(rows[j].request.request_id, []).append(j)
                    else:
                        failed[request_id] = describe_fault("verifying drafts", exc)
                    continue
            groups = retry
        self.speculator.record([r.seq.seq_id for r in rows],
                               [r.draft_token_ids.size for r in rows], verified.num_accepted)
        return verified

    def counters(self) -> dict:
        """vLLM's spec_decode counters."""
        stats = self.speculator.stats
        return {"spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens}
