"""The draft-model proposer: a smaller model sharing the target's tokenizer guesses k tokens per
speculating row, one decode pass per token, and gives their distributions q for verification.

KV layout: the draft's KV cache has the target's block count and is indexed by the target's
block tables and slot mappings -- every block id holds both models' KV for the same tokens. So
the scheduler's one block pool, its prefix cache, copy-on-write and swaps serve both, and a
block costs target + draft bytes (the engine plans capacity with their sum and logs it).

Invariant: every computed position (< num_computed_tokens) holds the draft's KV of the
request's token there. Per step, after schedule() and before the target's forward:
  1. catch-up: the draft runs the step's batch with each speculating row cut to its first
     query token (the last sampled token): prefill chunks, recomputed and plain decode rows get
     the draft's KV, block moves (swap, copy-on-write) are applied to the draft's pools too, and
     each speculating row's logits give its first draft d_0;
  2. passes i = 1 .. k: speculating rows with k_row >= i feed d_{i-1} at position L - 1 + i
     (the slots the scheduler allocated for the drafts), giving d_i (the pass i = k_row only
     writes d_{k-1}'s KV: when every draft is accepted, that position is computed);
  3. the drafts are written into the step's input ids (the target verifies them there).
Rejected drafts' KV sits at positions >= the new num_computed_tokens, rewritten before use.

Drafts come from q = the draft's processed weights (target_probs: the same processors and
filters as the target, with each position's history): the argmax for greedy rows, an
inverse-CDF draw for sampled rows (one uniform per row and position, from the request's
generator or the engine's).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from ..sampler import draw_uniforms, inverse_cdf
from .target_probs import processed_weights

_NO_OPS = np.zeros((0, 2), dtype=np.int32)


def _step(**fields) -> SimpleNamespace:
    """A step as ModelRunner.execute reads it: the SchedulerOutput fields it uses, by name
    (the shape of distributed.step_broadcast.StepInputs, which this layer may not import)."""
    fields.pop("seq", None)
    return SimpleNamespace(num_draft_tokens=None, **fields)


def catch_up_inputs(out, spec_rows: np.ndarray) -> SimpleNamespace:
    """The step `out` (SchedulerOutput) with each speculating row (spec_rows, sorted batch
    rows) cut to its first query token; block moves kept."""
    qsl = np.asarray(out.query_start_loc)
    query_lens = np.array(out.query_lens, dtype=np.int32)
    query_lens[spec_rows] = 1
    keep = np.ones(int(qsl[-1]), dtype=bool)
    for row in spec_rows:
        keep[qsl[row] + 1:qsl[row + 1]] = False
    new_qsl = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int32)
    context_lens = np.asarray(out.num_computed_tokens_before, dtype=np.int32) + query_lens
    return _step(
        num_batched_tokens=int(new_qsl[-1]), prompt_logit_rows=(),
        input_token_ids=np.ascontiguousarray(out.input_token_ids[keep]),
        positions=np.ascontiguousarray(out.positions[keep]),
        slot_mapping=np.ascontiguousarray(out.slot_mapping[keep]),
        query_start_loc=new_qsl, query_lens=query_lens, context_lens=context_lens,
        block_tables=out.block_tables, sample_mask=out.sample_mask,
        block_copies=out.block_copies, swap_out=out.swap_out, swap_in=out.swap_in)


def decode_pass_inputs(out, rows: np.ndarray, offset: int,
                       tokens: np.ndarray) -> SimpleNamespace:
    """One decode token per row in `rows`: tokens[j] at the row's query position `offset`
    (its slot the scheduler allocated); no block moves."""
    qsl = np.asarray(out.query_start_loc)
    at = qsl[rows] + offset
    num = rows.size
    return _step(
        num_batched_tokens=num, prompt_logit_rows=(),
        input_token_ids=np.ascontiguousarray(tokens, dtype=np.int32),
        positions=np.ascontiguousarray(out.positions[at]),
        slot_mapping=np.ascontiguousarray(out.slot_mapping[at]),
        query_start_loc=np.arange(num + 1, dtype=np.int32),
        query_lens=np.ones(num, dtype=np.int32),
        context_lens=np.ascontiguousarray(out.positions[at] + 1, dtype=np.int32),
        block_tables=np.ascontiguousarray(out.block_tables[rows]),
        sample_mask=np.ones(num, dtype=bool), block_copies=_NO_OPS, swap_out=_NO_OPS,
        swap_in=_NO_OPS)


class DraftModelProposer:
    def __init__(self, runner, eos_token_ids: Sequence[int]) -> None:
        """runner: a ModelRunner over the draft model whose KV pools have the target's block
        count (and swap blocks)."""
        self.runner = runner
        self.eos_token_ids = list(eos_token_ids)

    def _host(self, logits) -> np.ndarray:
        ops = self.runner.ops
        return np.asarray(ops.to_host(logits) if self.runner.logits_on_device else logits,
                          dtype=np.float32)

    def run(self, out, histories, engine_generator) -> dict[int, np.ndarray]:
        """Steps 1-3 of the module docstring for the step `out`. histories: batch row ->
        (params, prompt_token_ids, output_token_ids, generator) of each speculating row.
        Returns batch row -> the draft's weights q [k_row, vocab] (float32) of its drafts;
        the drafts themselves are written into out.input_token_ids."""
        counts = np.asarray(out.num_draft_tokens)
        spec_rows = np.flatnonzero(counts)
        executed = self.runner.execute(catch_up_inputs(out, spec_rows))
        if spec_rows.size == 0:
            return {}
        sample_rows = np.flatnonzero(out.sample_mask)
        logits = self._host(executed.logits)[np.searchsorted(sample_rows, spec_rows)]
        drafts = {int(r): [] for r in spec_rows}
        weights = {int(r): [] for r in spec_rows}
        rows = spec_rows
        for i in range(int(counts.max()) + 1):
            if i > 0:
                # Rows still drafting feed their last draft (i <= k_row: the pass i = k_row
                # writes its KV only).
                rows = spec_rows[counts[spec_rows] >= i]
                tokens = np.array([drafts[int(r)][i - 1] for r in rows], dtype=np.int32)
                executed = self.runner.execute(decode_pass_inputs(out, rows, i, tokens))
                logits = self._host(executed.logits)
            drafting = counts[rows] > i
            if not drafting.any():
                break
            self._draw(rows[drafting], logits[drafting], histories, drafts, weights,
                       engine_generator)
        qsl = np.asarray(out.query_start_loc)
        for row in spec_rows:
            out.input_token_ids[qsl[row] + 1:qsl[row] + 1 + counts[row]] = drafts[int(row)]
        return {r: np.stack(w) for r, w in weights.items()}

    def _draw(self, rows, logits, histories, drafts, weights, engine_generator) -> None:
        """Each row's next draft from the draft's processed weights of this position."""
        params, prompts, outputs, generators = [], [], [], []
        for row in rows:
            p, prompt, output, generator = histories[int(row)]
            params.append(p)
            prompts.append(prompt)
            outputs.append(list(output) + drafts[int(row)])
            generators.append(generator)
        q = processed_weights(logits, params, prompts, outputs, self.eos_token_ids)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        tokens = np.argmax(q, axis=1)  # greedy rows' weights are one-hot at the argmax
        if not greedy.all():
            uniforms = draw_uniforms(engine_generator, params, generators)
            sampled = np.flatnonzero(~greedy)
            tokens[sampled] = inverse_cdf(q[sampled], uniforms[sampled])
        for j, row in enumerate(rows):
            drafts[int(row)].append(int(tokens[j]))
            weights[int(row)].append(q[j])
