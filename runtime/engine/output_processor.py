"""OutputProcessor: a step's tokens become text, stops, logprobs and RequestOutputs.

Per new token (vLLM's order, runtime/stop_checker.py): append, check the token stops, then --
for requests with stop strings only -- detokenize and check the stop strings (a stop string
ends the request in the step that completes it; other requests' text is decoded when an
output's .text is first read, detokenizer.DeferredText). Rows that verified drafts are appended
one token at a time up to the first that ends the sequence, so no stop is overshot. Prompt
logprobs are filled from the raw logits of the chunks that compute them.

Nothing here touches the scheduler or the device; a fault in one request's part fails that
request alone (recorded in the step's `failed` map by the caller's rules).
"""
from __future__ import annotations

import time

import numpy as np

from pagedrun.runtime.detokenizer import TokenTexts, position_logprobs
from pagedrun.runtime.errors import describe_fault
from pagedrun.runtime.outputs import RequestOutput
from pagedrun.runtime.request import Request, Sequence, take_outputs
from pagedrun.runtime.sampler import SamplerOutput, log_softmax, token_logprobs
from pagedrun.runtime.spec_decode.spec_step import VerifiedRows
from pagedrun.runtime.stop_checker import (FINISH_STOP, check_token_stop, find_stop_string,
                                           needs_text, token_stop_bounds)

from .request_table import RequestTable
from .sampling_plan import SamplingBatch


class OutputProcessor:
    def __init__(self, table: RequestTable, tokenizer, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.table = table
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.token_texts = TokenTexts(tokenizer)  # Logprob.decoded_token, cached per id
        self.generation_tokens_total = 0

    @staticmethod
    def outputs(touched: dict[str, Request]) -> list[RequestOutput]:
        """The step's outputs: one per touched request, as its output_kind asks (a
        FINAL_ONLY request still running has none)."""
        return take_outputs(touched.values())

    # ------------------------------------------------------------------ sampled tokens
    def append_sampled(self, batch: SamplingBatch, sampled: SamplerOutput,
                       verified: VerifiedRows | None, failed: dict[str, str],
                       touched: dict[str, Request]) -> tuple[dict[str, Request], list[int],
                                                             bool, list[list[int]]]:
        """Append every token of the step to its sequence and check its stops: the sampled
        rows, then the spec rows' tokens one at a time, up to the first that ends the sequence
        (so a stop is never overshot). A token of a request without stop strings that neither
        reaches the length limit nor is a stop token id (Request.token_stops) is only appended:
        check_token_stop would answer None; every other token takes append_token.

        Returns (ended: the requests with a sequence that ended, stopped: the indices into
        batch.targets of the sequences that ended, complete: every target got its token,
        emitted: per spec row, the tokens the scheduler appends)."""
        now = time.monotonic()
        sampled_ids = sampled.token_ids.tolist()  # Python ints, one conversion per step
        append_token = self.append_token
        ended: dict[str, Request] = {}
        stopped: list[int] = []
        complete = True
        num_appended = 0  # tokens appended here without append_token (which counts its own)
        for j, (_, seq, request) in enumerate(batch.targets):
            request_id = request.request_id
            if request.finished or (failed and request_id in failed):  # finished: aborted
                complete = False                                       # in flight
                continue
            token = sampled_ids[j]
            try:
                if seq.logprobs is not None:
                    entry = sampled.logprobs[j]  # TokenLogprobs
                    seq.logprobs.append(position_logprobs(entry, self.token_texts))
                    seq.cumulative_logprob += entry.logprob
                stops = request.token_stops
                if stops is None:
                    stops = request.token_stops = self.token_stops(request)
                output_token_ids = seq.output_token_ids
                if (stops and seq.finish_reason is None and len(output_token_ids) + 1 < stops[0]
                        and token not in stops[1]):
                    output_token_ids.append(token)
                    num_appended += 1
                else:
                    append_token(request, seq, token)
                    if seq.finish_reason is not None:
                        stopped.append(j)
                        ended[request_id] = request
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed[request_id] = describe_fault("postprocessing a token", exc)
                complete = False
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request_id] = request
        self.generation_tokens_total += num_appended
        emitted: list[list[int]] = []
        for j, spec in enumerate(batch.spec):
            request, seq = spec.request, spec.seq
            emitted.append([])
            if request.request_id in failed:
                continue
            try:
                for i, token in enumerate(verified.tokens[j]):
                    if verified.logprobs[j] is not None:
                        entry = verified.logprobs[j][i]
                        seq.logprobs.append(position_logprobs(entry, self.token_texts))
                        seq.cumulative_logprob += entry.logprob
                    self.append_token(request, seq, int(token))
                    emitted[j].append(int(token))
                    if seq.finished:
                        ended[request.request_id] = request
                        break
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed[request.request_id] = describe_fault("postprocessing a token", exc)
                continue
            touched[request.request_id] = request
        return ended, stopped, complete, emitted

    def token_stops(self, request: Request) -> tuple[int, frozenset[int]] | bool:
        """Request.token_stops: False (every token takes append_token) for a request whose
        text the engine decodes as it goes, else its stop_checker.token_stop_bounds."""
        if needs_text(request.params):
            return False
        return token_stop_bounds(request.params, len(request.prompt_token_ids),
                                 self.eos_token_ids, self.max_model_len)

    def append_token(self, request: Request, seq: Sequence, token: int) -> None:
        """Append one sampled token: the token stop checks first (they decide whether its
        text is shown), then detokenization, then the stop strings on the new text
        (runtime/stop_checker.py has the rules and their order). Without stop strings nothing
        here reads the text: it is left to whoever reads the outputs (request.py), and only
        where it ends is recorded."""
        params = request.params
        output_token_ids = seq.output_token_ids
        output_token_ids.append(token)
        self.generation_tokens_total += 1
        num_output = len(output_token_ids)
        stop = check_token_stop(params, token, num_output,
                                len(request.prompt_token_ids) + num_output, self.eos_token_ids,
                                self.max_model_len)
        if stop is None:
            seq.finish_reason = seq.stop_reason = None
        else:
            seq.finish_reason, seq.stop_reason = stop
        detokenizer = seq.detokenizer
        if detokenizer is None:
            return
        shows_token = (stop is None or stop[0] != FINISH_STOP
                       or params.include_stop_str_in_output)
        if not needs_text(params):
            if stop is not None:  # its text: the tokens up to here (or before), then finish()
                seq.final_text_tokens = num_output if shows_token else num_output - 1
            return
        text_before = len(seq.text)
        if shows_token:
            seq.text += detokenizer.add_token(token)
        if stop is not None:  # bytes held for earlier tokens (never the skipped stop token's)
            seq.text += detokenizer.finish()
        if num_output <= params.min_tokens:
            return
        hit = find_stop_string(seq.text, len(seq.text) - text_before, params.stop,
                               params.include_stop_str_in_output)
        if hit is not None:
            seq.finish_reason, seq.stop_reason = FINISH_STOP, hit[0]
            seq.text = seq.text[:hit[1]]

    @staticmethod
    def scheduler_rows(req_ids: np.ndarray,
                       batch: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
        """Each scheduler row's sampled token and stop flag, from its sequence (rows that did
        not sample, and those of failed requests, get 0 and no stop; the scheduler skips the
        latter). An n > 1 parent that stops on its first token while a sibling lives stays
        running until the siblings are forked from it. Built as lists (a numpy element write
        costs more than the rest of the row)."""
        row_seq_ids = req_ids.tolist()
        row_tokens = [0] * len(row_seq_ids)
        row_stops = [False] * len(row_seq_ids)
        siblings_of = {id(parent): sibs for parent, sibs in batch.forks}
        for row, seq, request in batch.targets:
            if seq.seq_id != row_seq_ids[row] or request.finished:
                continue  # a sibling (not a scheduler row yet), or failed
            row_tokens[row] = seq.output_token_ids[-1]
            if seq.finish_reason is not None:
                row_stops[row] = not (siblings_of and any(
                    not s.finished for s in siblings_of.get(id(seq), ())))
        return np.array(row_tokens, dtype=np.int32), np.array(row_stops, dtype=bool)

    # ------------------------------------------------------------------ prompt logprobs
    def wants_prompt_logits(self, seq_id: int, num_computed_before: int, query_len: int) -> bool:
        """Whether this row's chunk holds the next prompt position still missing a logprob.

        Row j of a chunk starting at position p predicts prompt token p + j + 1. Chunks after a
        recompute preemption need not line up with the first pass, so overlap is what counts.
        """
        request, seq = self.table.seqs[seq_id]
        if request.prompt_logprobs is None or seq.index != 0:
            return False
        need = len(request.prompt_logprobs)  # the next prompt token without a logprob
        return (need < len(request.prompt_token_ids)
                and num_computed_before + 1 <= need <= num_computed_before + query_len)

    def add_prompt_logprobs(self, seq_id: int, num_computed_before: int,
                            logits: np.ndarray) -> None:
        """logits[j] (position num_computed_before + j) predicts the prompt token at +1."""
        request, _ = self.table.seqs[seq_id]
        prompt = request.prompt_token_ids
        first = len(request.prompt_logprobs)
        last = min(num_computed_before + logits.shape[0], len(prompt) - 1)  # inclusive
        if last < first:
            return
        # Prompt logprobs come from the raw logits whatever logprobs_mode says (vLLM's too).
        rows = log_softmax(logits[first - 1 - num_computed_before:last - num_computed_before])
        num_top = request.params.prompt_logprobs
        request.prompt_logprobs.extend(
            position_logprobs(token_logprobs(row, token, num_top), self.token_texts)
            for row, token in zip(rows, prompt[first:last + 1]))

    def prompt_logprobs_of(self, out, prompt_logits: dict, failed: dict[str, str]) -> None:
        """Each row of `prompt_logits` (batch row -> its query tokens' logits) extends its
        request's prompt logprobs; a fault fails that request alone."""
        req_ids = out.req_ids
        for row, logits in prompt_logits.items():
            seq_id = int(req_ids[row])
            entry = self.table.seqs.get(seq_id)
            if entry is None:  # aborted while its batch was in flight (pipelining)
                continue
            try:
                self.add_prompt_logprobs(seq_id, int(out.num_computed_tokens_before[row]),
                                         logits)
            except Exception as exc:  # noqa: BLE001 -- this request's fault only
                failed.setdefault(entry[0].request_id, describe_fault("prompt logprobs", exc))
