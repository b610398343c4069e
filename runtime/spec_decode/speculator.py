"""The engine's side of speculative decoding: drafts before the step, verification after it,
and the policy that says when speculation is off.

Per step (LLMEngine.step):
  1. `propose`: the scheduler's running decodes get the n-gram proposer's drafts
     (`Scheduler.set_draft_tokens`), up to `max_draft(seq_id)` each -- the engine says how many a
     sequence may take (0: none, e.g. its logprobs are asked in a processed mode); with a draft
     model, placeholders: how many drafts each may take (the tokens come after schedule());
  2. the scheduler gives each such row a query of 1 + k tokens (k cut to the spare budget and
     blocks); a draft model then writes its k drafts into the step (draft_model.py); the
     runner returns the logits of those 1 + k positions;
  3. `verify`: the target's per-position weights (target_probs.verification_weights: the plain
     sampler's processors and filters, with each position's history) and the rejection sampler
     (numpy reference, or cuda/rejection_sample.cu on the kernel backends) give each row its
     emitted tokens: the accepted drafts, then a correction or bonus token;
  4. `record`: counters (vLLM's spec_decode_num_drafts / _num_draft_tokens /
     _num_accepted_tokens) and the acceptance average the policy reads.

Policy (logged): no drafts in a step whose running decodes number `disable_by_batch_size` or
more (verification's extra tokens cost compute that a large batch no longer has spare; when the
config sets none, the backend's default: 4 on the cpu backends, none on sim/cuda); and per
sequence, none for PAUSE_STEPS of its steps after its acceptance rate -- an exponential average
over its steps with drafts, weight ACCEPTANCE_EMA_WEIGHT, judged after MIN_STEPS_BEFORE_PAUSE
of them -- falls below MIN_ACCEPTANCE_RATE (rejected drafts are pure cost); then it probes
again from a fresh average. Per sequence, because one request's text (code, a summary) says
nothing about whether another one (a copy) repeats itself.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..sampler import log_softmax, token_logprobs
from ..sampling_params import SamplingParams
from .draft_model import DraftModelProposer
from .ngram_proposer import NgramProposer
from .rejection_sampler import RejectionOutput, draw_spec_uniforms, rejection_sample
from .spec_config import SpeculativeConfig
from .target_probs import verification_weights

log = logging.getLogger("pagedrun.engine")

# Below this average share of accepted drafts, speculation pauses (a step with k drafts costs
# about k extra query tokens; at 25% acceptance and k = 4 it emits about 1.3 tokens).
MIN_ACCEPTANCE_RATE = 0.25
ACCEPTANCE_EMA_WEIGHT = 0.1
PAUSE_STEPS = 64
# Steps with drafts before the average may pause speculation (one unlucky step is no trend).
MIN_STEPS_BEFORE_PAUSE = 8


@dataclass
class SpecRow:
    """One speculating row of a step: the batch row, its logits rows [start, start + k + 1)
    in RunnerOutput.logits, and the k drafts it verified (the row's query tokens after the
    first)."""

    row: int
    seq: object       # runtime.request.Sequence
    request: object   # runtime.request.Request
    logits_start: int
    draft_token_ids: np.ndarray  # int32 [k]


@dataclass
class _Acceptance:
    """One sequence's acceptance average and pause (the policy in the module docstring)."""

    rate: float | None = None
    steps: int = 0
    paused_steps_left: int = 0


@dataclass
class SpecStats:
    num_drafts: int = 0           # rows that verified at least one draft
    num_draft_tokens: int = 0     # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted


class Speculator:
    def __init__(self, config: SpeculativeConfig, eos_token_ids: Sequence[int],
                 logprobs_mode: str, rejection_kernel: Callable | None = None,
                 draft: DraftModelProposer | None = None,
                 default_disable_by_batch_size: int | None = None) -> None:
        """rejection_kernel: None (numpy reference) or a function with
        rejection_sampler.rejection_sample's signature (the backend's kernel). draft: the
        draft model's proposer (method "draft_model"), None for "ngram".
        default_disable_by_batch_size: the backend's limit when the config sets none."""
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative_config: method {config.method!r} with"
                             f"{'' if draft is not None else 'out'} a draft model")
        self.config = config
        self.disable_by_batch_size = (config.disable_by_batch_size
                                      if config.disable_by_batch_size is not None
                                      else default_disable_by_batch_size)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.draft = draft
        self.proposer = NgramProposer.from_config(config) if draft is None else None
        self.eos_token_ids = list(eos_token_ids)
        self.logprobs_mode = logprobs_mode
        self.rejection_kernel = rejection_kernel
        self.stats = SpecStats()
        self._acceptance: dict[int, _Acceptance] = {}  # seq_id -> its policy state
        self._off_reason: str | None = None

    # ------------------------------------------------------------------ policy

    def _why_off(self, num_decodes: int) -> str | None:
        limit = self.disable_by_batch_size
        if limit is not None and num_decodes >= limit:
            return f"running decodes >= disable_by_batch_size {limit}"
        return None

    def _set_off_reason(self, reason: str | None) -> None:
        if reason == self._off_reason:
            return
        if reason is None:
            log.info("speculative decoding on")
        else:
            log.info("speculative decoding off: %s", reason)
        self._off_reason = reason

    def _paused(self, seq_id: int) -> bool:
        """Whether this sequence sits out this step (counting the step off its pause)."""
        state = self._acceptance.get(seq_id)
        if state is None or state.paused_steps_left == 0:
            return False
        state.paused_steps_left -= 1
        return True

    @property
    def off_reason(self) -> str | None:
        """Why the last step proposed nothing (None: it was allowed to)."""
        return self._off_reason

    # ------------------------------------------------------------------ 1. propose

    def propose(self, scheduler, max_draft: Callable[[int], int]) -> int:
        """Give the scheduler's running decodes their drafts for the next schedule(); returns
        how many drafts were set. max_draft(seq_id): the most this sequence may take."""
        seq_ids = scheduler.get_decode_request_ids()
        live = set(seq_ids.tolist())
        for gone in [i for i in self._acceptance if i not in live]:
            del self._acceptance[gone]  # finished or preempted: its average goes with it
        reason = self._why_off(len(seq_ids))
        self._set_off_reason(reason)
        if reason is not None or not len(seq_ids):
            return 0
        caps = np.array([0 if self._paused(int(i)) else
                         min(max_draft(int(i)), self.num_speculative_tokens)
                         for i in seq_ids], dtype=np.int64)
        rows = np.flatnonzero(caps > 0)
        if rows.size == 0:
            return 0
        ids = seq_ids[rows]
        if self.draft is not None:  # how many each may take; the draft fills them in later
            proposals = [np.zeros(int(c), dtype=np.int32) for c in caps[rows]]
        else:
            proposals = self.proposer.propose([scheduler.get_token_ids(int(i)) for i in ids],
                                              caps[rows])
        counts = np.array([p.size for p in proposals], dtype=np.int32)
        if not counts.any():
            return 0
        drafts = np.zeros((ids.size, int(counts.max())), dtype=np.int32)
        for j, p in enumerate(proposals):
            drafts[j, :p.size] = p
        scheduler.set_draft_tokens(ids, drafts, counts)
        return int(counts.sum())

    # ------------------------------------------------------------------ 3. verify

    def verify(self, logits: np.ndarray, rows: Sequence[SpecRow],
               engine_generator: np.random.Generator,
               draft_weights: dict[int, np.ndarray] | None = None) -> RejectionOutput:
        """The emitted tokens of `rows` (in order). logits: [sum_b (k_b + 1), vocab] float32
        host rows, row after row (each SpecRow's logits, concatenated). draft_weights: batch
        row -> q [k_row, vocab] (a draft model's), None: n-gram drafts (point masses)."""
        params: list[SamplingParams] = [r.request.params for r in rows]
        drafts = [r.draft_token_ids for r in rows]
        weights = verification_weights(
            logits, params, [r.request.prompt_token_ids for r in rows],
            [r.seq.output_token_ids for r in rows], drafts, self.eos_token_ids)
        counts = np.array([d.size for d in drafts], dtype=np.int32)
        padded = np.zeros((len(rows), weights.shape[1] - 1), dtype=np.int32)
        for b, d in enumerate(drafts):
            padded[b, :d.size] = d
        greedy = np.array([p.greedy for p in params], dtype=bool)
        uniforms = draw_spec_uniforms(engine_generator, params,
                                      [r.seq.generator for r in rows], counts)
        q = None
        if draft_weights is not None:
            q = np.zeros((len(rows), padded.shape[1], weights.shape[2]), dtype=np.float32)
            for b, r in enumerate(rows):
                q[b, :counts[b]] = draft_weights[r.row]
        sample = self.rejection_kernel or rejection_sample
        return sample(weights, padded, counts, q, greedy, uniforms)

    def logprobs(self, logits_row: np.ndarray, token: int, num_top: int):
        """The target's logprobs entry of one emitted token (raw modes only: the engine gives
        no drafts to rows whose logprobs are asked in a processed mode)."""
        values = logits_row if self.logprobs_mode == "raw_logits" else log_softmax(
            logits_row[None, :])[0]
        return token_logprobs(values, token, num_top)

    # ------------------------------------------------------------------ 4. record

    def record(self, seq_ids: Sequence[int], num_draft_tokens: Sequence[int],
               num_accepted: Sequence[int]) -> None:
        """One step's verified rows: each row's sequence, drafts and accepted drafts."""
        for seq_id, drafted, accepted in zip(seq_ids, num_draft_tokens, num_accepted):
            if drafted == 0:
                continue
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += int(drafted)
            self.stats.num_accepted_tokens += int(accepted)
            state = self._acceptance.setdefault(int(seq_id), _Acceptance())
            rate = accepted / drafted
            state.steps += 1
            state.rate = rate if state.rate is None else (
                (1 - ACCEPTANCE_EMA_WEIGHT) * state.rate + ACCEPTANCE_EMA_WEIGHT * rate)
            if state.steps >= MIN_STEPS_BEFORE_PAUSE and state.rate < MIN_ACCEPTANCE_RATE:
                log.info("speculative decoding paused for sequence %d for %d steps: its "
                         "acceptance rate %.0f%% < %.0f%%", seq_id, PAUSE_STEPS,
                         100 * state.rate, 100 * MIN_ACCEPTANCE_RATE)
                self._acceptance[int(seq_id)] = _Acceptance(paused_steps_left=PAUSE_STEPS)
