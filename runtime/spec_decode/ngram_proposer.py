"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of a
request's last n tokens (prompt + output so far), for a whole batch in one vectorized pass.

Rule, per request with tokens t[0..L-1]: for n from prompt_lookup_max down to
prompt_lookup_min, look for the latest start j < L - n with t[j:j+n] == t[L-n:] (an occurrence
may overlap the suffix itself, as in "a a a a"); the first n that has one wins, and the proposal
is t[j+n : j+n+k] (fewer than k tokens when the match sits near the end; never empty, since
j + n <= L - 1). No match: an empty proposal. k is num_speculative_tokens, further capped per
request by `max_num_tokens` (what the request may still produce: max_model_len, max_tokens).
Longest n first, then the latest position: recent text is the likeliest to be repeated.

How (no Python loop over positions): the batch is concatenated into one flat array. One
vectorized pass over every token keeps the candidate end positions e <= L - 2 whose token
equals the request's last token (the suffix itself is not a match); then for i = 1, 2, ... up to
prompt_lookup_max - 1, one vectorized comparison t[e - i] == t[L-1-i] over the surviving
candidates only, which gives each candidate's match length. Per request, the longest match
(counted only if >= prompt_lookup_min), then the latest e, is found by one lexsort of the
survivors. Cost: O(total tokens) for the first pass, then O(survivors) per length.

Shapes: token_ids: list of [L_b] int arrays; returns list of [0..k] int32 arrays.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .spec_config import SpeculativeConfig


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got "
                             f"{num_speculative_tokens}")
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)
        self.k = int(num_speculative_tokens)

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        return cls(config.prompt_lookup_min, config.prompt_lookup_max,
                   config.num_speculative_tokens)

    def propose(self, token_ids: Sequence[np.ndarray],
                max_num_tokens: Sequence[int] | None = None) -> list[np.ndarray]:
        """One proposal per request (possibly empty). token_ids[b]: [L_b] the request's prompt
        followed by its output so far. max_num_tokens[b]: at most this many tokens for request
        b (<= 0: none); None: k for every request."""
        num_rows = len(token_ids)
        caps = np.full(num_rows, self.k, dtype=np.int64)
        if max_num_tokens is not None:
            if len(max_num_tokens) != num_rows:
                raise ValueError(f"{num_rows} requests but {len(max_num_tokens)} caps")
            caps = np.minimum(caps, np.asarray(max_num_tokens, dtype=np.int64))
        empty = np.zeros(0, dtype=np.int32)
        proposals = [empty] * num_rows
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        # A match of >= min_n tokens ending at e <= L - 2 needs L >= min_n + 1.
        rows = np.flatnonzero((lengths > self.min_n) & (caps > 0))
        if rows.size == 0:
            return proposals
        flat = np.concatenate([np.asarray(token_ids[b]) for b in rows])
        row_len = lengths[rows]
        starts = np.concatenate(([0], np.cumsum(row_len)[:-1]))
        ends = starts + row_len - 1  # each request's last token
        # Pass 1 over every token: candidate end positions hold the request's last token.
        candidates = flat == np.repeat(flat[ends], row_len)
        candidates[ends] = False  # the suffix itself is not an earlier occurrence
        cand_end = np.flatnonzero(candidates)
        owner = np.searchsorted(starts, cand_end, side="right") - 1
        match_len = self._match_lengths(flat, cand_end, starts[owner], ends[owner])
        found = match_len >= self.min_n
        cand_end, owner, match_len = cand_end[found], owner[found], match_len[found]
        # Per request: the longest match, then the latest position (lexsort: last key first).
        order = np.lexsort((cand_end, match_len, owner))
        last_of_owner = np.flatnonzero(np.diff(owner[order], append=-1) != 0)
        for j in order[last_of_owner]:
            i = owner[j]
            first = cand_end[j] + 1  # the token after the match
            count = min(int(caps[rows[i]]), int(ends[i] - first + 1))
            proposals[rows[i]] = flat[first:first + count].astype(np.int32)
        return proposals

    def _match_lengths(self, flat: np.ndarray, cand_end: np.ndarray, cand_start: np.ndarray,
                       cand_last: np.ndarray) -> np.ndarray:
        """[candidates] int64: how many tokens (<= max_n) end at each candidate position and
        equal the same number of tokens ending its request's last token (>= 1: candidates
        already match the last token)."""
        match_len = np.ones(cand_end.size, dtype=np.int64)
        alive = np.arange(cand_end.size)
        for i in range(1, self.max_n):
            src = cand_end[alive] - i
            # src < last - i always; src >= start keeps the comparison inside the request.
            ok = src >= cand_start[alive]
            alive, src = alive[ok], src[ok]
            alive = alive[flat[src] == flat[cand_last[alive] - i]]
            if alive.size == 0:
                break
            match_len[alive] += 1
        return match_len
