"""Which sequence samples from which logits row, and the sampling itself, fault-contained.

`plan_sampling` runs before the forward: it is the one place where an n > 1 request expands
(its first sample yields n sequences from one logits row; the siblings are made here and forked
onto the parent's blocks at postprocessing), where prompt-logprob rows are picked, and where
the rows that verify drafts are set apart (the rejection sampler gives their tokens). It also
records prefix-cache hits and the first scheduled time of new requests.

`sample` runs after it: one token per sampling row, by the backend's sampler, where the logits
are. If the batch fails, each request's rows are sampled alone so the one at fault is found
(and failed); the others get their tokens.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedrun.runtime.errors import describe_fault
from pagedrun.runtime.request import Request, Sequence
from pagedrun.runtime.sampler import SamplerOutput
from pagedrun.runtime.spec_decode.speculator import SpecRow

from .request_table import RequestTable


@dataclass
class SamplingBatch:
    """The sampling rows of one step, planned before it executes.

    targets: one (batch row, sequence, request) per sampling row, in the sampler's row order;
    row_index: per sampling row, the logits row it reads (RunnerOutput.logits has one row per
        sample row of the batch; the n sequences of an n > 1 request's first token share one);
    forks: (parent, siblings) of each n > 1 request expanded this step;
    prompt_logit_rows: batch rows whose every query token's logits are wanted (prompt logprobs).
    spec: the rows that verify drafts (speculative decoding), in batch order; they are not in
        `targets` (the rejection sampler, not the plain one, gives their tokens).
    """

    targets: list[tuple[int, Sequence, Request]] = field(default_factory=list)
    row_index: list[int] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)
    prompt_logit_rows: tuple[int, ...] = ()
    spec: list[SpecRow] = field(default_factory=list)

    def sampler_args(self, rows: list[int] | None = None) -> tuple[list, list, list, list, list]:
        """(params, generators, prompt ids, output ids, row_index) of the targets `rows`
        (indices into targets; None: all), as the sampler takes them."""
        targets = self.targets if rows is None else [self.targets[j] for j in rows]
        row_index = self.row_index if rows is None else [self.row_index[j] for j in rows]
        return ([t[2].params for t in targets], [t[1].generator for t in targets],
                [t[2].prompt_token_ids for t in targets],
                [t[1].output_token_ids for t in targets], row_index)


def plan_sampling(out, table: RequestTable, failed: dict[str, str],
                  wants_prompt_logits: Callable[[int, int, int], bool]) -> SamplingBatch:
    """The SamplingBatch of SchedulerOutput `out` (module docstring). A request whose n > 1
    expansion fails is failed in `failed` alone."""
    now = time.monotonic()
    seqs = table.seqs
    for seq_id, num_cached in zip(out.new_req_ids.tolist(),
                                  out.num_prefix_cached_tokens.tolist()):
        request, seq = seqs[seq_id]
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if seq.index == 0 and not seq.output_token_ids and not request.num_cached_prompt_tokens:
            request.num_cached_prompt_tokens = num_cached
    # Python ints and (request, sequence) per row, converted once: this runs per row.
    row_seq_ids = out.req_ids.tolist()
    entries = [seqs[seq_id] for seq_id in row_seq_ids]
    batch = SamplingBatch(prompt_logit_rows=tuple(
        row for row, entry in enumerate(entries)
        if entry[0].prompt_logprobs is not None and wants_prompt_logits(
            row_seq_ids[row], int(out.num_computed_tokens_before[row]),
            int(out.query_lens[row]))))
    sample_rows = np.flatnonzero(out.sample_mask)  # RunnerOutput.sample_rows
    num_drafts = None  # per row, only when some row verifies drafts
    logits_start = range(sample_rows.size)  # RunnerOutput.logits_start, if any
    if out.total_draft_tokens:
        num_drafts = out.num_draft_tokens.tolist()
        logits_start = (np.cumsum(out.num_draft_tokens[sample_rows] + 1) - (
            out.num_draft_tokens[sample_rows] + 1)).tolist()
    targets, row_index = batch.targets, batch.row_index
    for row, start in zip(sample_rows.tolist(), logits_start):
        request, seq = entries[row]
        if num_drafts is not None and num_drafts[row]:
            # Verifies its drafts: the query tokens after its last token.
            num_draft = num_drafts[row]
            first = int(out.query_start_loc[row]) + 1
            batch.spec.append(SpecRow(row, seq, request, start,
                                      out.input_token_ids[first:first + num_draft]))
            continue
        if request.params.n <= 1 or request.forked:  # one sequence samples from the row
            targets.append((row, seq, request))
            row_index.append(start)
            continue
        request.forked = True
        try:
            siblings = [table.new_sequence(request, k) for k in range(1, request.params.n)]
        except Exception as exc:  # noqa: BLE001 -- this request's fault only
            failed[request.request_id] = describe_fault("expanding n > 1", exc)
            continue
        batch.forks.append((seq, siblings))
        for s in [seq, *siblings]:
            targets.append((row, s, request))
            row_index.append(start)
    return batch


def sample(sampler, batch: SamplingBatch, logits, failed: dict[str, str]) -> SamplerOutput:
    """One token per sampling row of `batch` from `logits` (RunnerOutput.logits). Failed
    rows get token -1 and no logprobs; a request whose rows fail alone is failed in `failed`."""
    token_ids = np.full(len(batch.targets), -1, np.int32)
    logprobs: list = [None] * len(batch.targets)
    rows = [j for j, t in enumerate(batch.targets) if t[2].request_id not in failed]
    groups = {None: rows} if rows else {}  # one batch first; per request if it fails
    while groups:
        retry: dict[str, list[int]] = {}
        for request_id, own in groups.items():
            params, generators, prompts, outputs, row_index = batch.sampler_args(own)
            try:
                part = sampler.sample(logits, params, generators, prompts, outputs,
                                      row_index=row_index)
            except Exception as exc:  # noqa: BLE001
                if request_id is None:  # find the request it belongs to
                    for j in own:
                        retry.setdefault(batch.targets[j][2].request_id, []).append(j)
                else:  # this request's fault only
                    failed[request_id] = describe_fault("sampling", exc)
                continue
            token_ids[own] = part.token_ids
            for j, lp in zip(own, part.logprobs):
                logprobs[j] = lp
        groups = retry
    return SamplerOutput(token_ids, logprobs)
