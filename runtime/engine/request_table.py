"""RequestTable: the engine's live requests and their sequences, by id.

A user request (a string id) owns `params.n` sequences; each sequence is one scheduler request
(an int id). The table is the one place that maps between them, counts each virtual engine's
unfinished requests (admission picks the least loaded), and holds the requests aborted since
the last step (their final outputs leave with the next step's). Nothing here touches the
scheduler or the device: finishing a request only forgets it; whoever finishes it has freed its
blocks first.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from pagedrun.runtime.detokenizer import IncrementalDetokenizer
from pagedrun.runtime.request import Request, Sequence
from pagedrun.runtime.sampler import make_request_generator


class RequestTable:
    def __init__(self, num_virtual_engines: int, tokenizer=None,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        """`on_finish(request)`: called as a request leaves the table (LoRA unpinning)."""
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, tuple[Request, Sequence]] = {}  # seq id -> (request, sequence)
        self.per_virtual_engine = [0] * num_virtual_engines  # unfinished requests of each
        self.pending_final: list[Request] = []  # aborted since the last step
        self._on_finish = on_finish
        self._seq_ids = itertools.count(1)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def least_loaded_virtual_engine(self) -> int:
        """vLLM's choice for a new request; 0 without pipelining."""
        loads = self.per_virtual_engine
        return min(range(len(loads)), key=loads.__getitem__)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.per_virtual_engine[request.virtual_engine] += 1

    def new_sequence(self, request: Request, index: int) -> Sequence:
        """Sequence `index` of `request`, registered under a fresh scheduler id."""
        params = request.params
        # Sequence j of a seeded request draws from seed + j (vLLM's ParentRequest); None:
        # the engine's stream.
        generator = make_request_generator(params.seed, index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                           params.skip_special_tokens)
        seq = Sequence(next(self._seq_ids), index, generator, detok,
                       logprobs=[] if params.logprobs is not None else None)
        request.seqs.append(seq)
        self.seqs[seq.seq_id] = (request, seq)
        return seq

    def forget_sequence(self, seq_id: int) -> None:
        """Drop a sequence never handed to a scheduler (its admission was refused)."""
        del self.seqs[seq_id]

    def finish(self, request: Request) -> None:
        """The request leaves the table: finished, its sequences forgotten."""
        request.finished = True
        request.finished_time = time.monotonic()
        for seq in request.seqs:
            self.seqs.pop(seq.seq_id, None)
        del self.requests[request.request_id]
        self.per_virtual_engine[request.virtual_engine] -= 1
        if self._on_finish is not None:
            self._on_finish(request)

    def take_pending_final(self) -> dict[str, Request]:
        """The requests aborted since the last step, as a step's `touched` map."""
        touched = {r.request_id: r for r in self.pending_final}
        self.pending_final = []
        return touched

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending_final)
