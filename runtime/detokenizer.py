"""Incremental detokenization for streaming: token ids in, text deltas out.

A token is not a unit of text. A byte-level BPE token can hold half of a UTF-8 character (the
emoji "🎉" is three tokens in SmolLM2), a SentencePiece byte-fallback token holds one byte, and
some decoders change a token's text depending on what precedes it (SentencePiece drops the
leading space of the first token). So text cannot be produced token by token.

The technique (two offsets into the token list): `read_offset` is where the text already handed
out ends, `prefix_offset` a few tokens earlier, at a point where the decoded text ended on a
complete character. Each new token decodes the window `[prefix_offset:]` and the older window
`[prefix_offset:read_offset]`; the new text is the difference. When the window's text ends with
U+FFFD the last bytes are an incomplete character, so nothing is handed out and the offsets stay
until a later token completes it. Decoding a short window keeps each step O(window), not
O(sequence). `finish()` hands out whatever is still held (an incomplete tail becomes U+FFFD,
exactly as a full decode shows it), so the concatenated deltas always equal a full decode.

`DeferredText` runs the same detokenizer later, off the engine's step: a sequence without stop
strings needs no text inside the engine, so each of its outputs carries a mark (how many of its
tokens its text covers) and the text is made from the marks when the output's `text` is first
read, on the reader's thread (the server's I/O thread). vLLM makes the same cut: its engine core
hands out token ids and its front-end process detokenizes.

Also here: the text of single tokens for logprobs (`TokenTexts`, vLLM's `decoded_token`) and the
conversion of a sampler's TokenLogprobs into the {token_id: Logprob} dict users see.
"""
from __future__ import annotations

import logging
import threading
import weakref
from array import array
from typing import Any, Callable, Iterable, Sequence

from pagedrun.runtime.outputs import Logprob, PositionLogprobs, TokenLogprobs

log = logging.getLogger("pagedrun.detokenizer")

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first generated token, so that context-dependent decoders
# (SentencePiece's leading-space rule) see the generated text the way a full decode would.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for one sequence.

    tokenizer: anything with `decode(token_ids, skip_special_tokens=...) -> str` (our
    `Tokenizer`). prompt_token_ids: the prompt, of which only the last PROMPT_CONTEXT_TOKENS are
    used as decoding context; the prompt's own text is never emitted.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self.token_ids: list[int] = context
        self.num_context_tokens = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        # The text of the window [prefix_offset:read_offset] while the offsets stay (None: not
        # decoded yet), and the tokenizer's one-token texts: once every token completes a
        # character, that window is the previous token alone, so a step costs one decode.
        self._prefix_text: str | None = None
        self._single_texts = _single_token_texts(tokenizer, skip_special_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids added so far (the prompt context excluded)."""
        return self.token_ids[self.num_context_tokens:]

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _prefix_window_text(self) -> str:
        """decode(token_ids[prefix_offset:read_offset]), decoded once per pair of offsets."""
        text = self._prefix_text
        if text is None:
            start, end = self.prefix_offset, self.read_offset
            if end - start == 1:
                token_id = self.token_ids[start]
                text = self._single_texts.get(token_id)
                if text is None:
                    text = self._single_texts[token_id] = self._decode([token_id])
            else:
                text = self._decode(self.token_ids[start:end])
            self._prefix_text = text
        return text

    def add_token(self, token_id: int) -> str:
        """Append one id; return the text it completes (often "", never a partial character)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._prefix_window_text()
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = None
        self.text += delta
        return delta

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append several ids; return the concatenated delta."""
        return "".join(self.add_token(t) for t in token_ids)

    def finish(self) -> str:
        """Hand out what is held back at the end of the sequence (incomplete bytes -> U+FFFD)."""
        prefix_text = self._prefix_window_text()
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self._prefix_text = None
        self.text += delta
        return delta


# tokenizer -> {skip_special_tokens: {token_id: decode([token_id])}}, shared by every sequence
# (bounded by the vocabulary; gone with the tokenizer).
_SINGLE_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _single_token_texts(tokenizer: Any, skip_special_tokens: bool) -> dict[int, str]:
    try:
        per_tokenizer = _SINGLE_TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: its own cache
        return {}
    return per_tokenizer.setdefault(skip_special_tokens, {})


# DeferredText mark of a finished sequence's text: its last token added, then finish().
FINAL_MARK = -1


class DeferredText:
    """The text of one sequence, detokenized only when someone reads it.

    A mark says how much of the text an output covers: `n` -- the first n output tokens added
    with IncrementalDetokenizer.add_token, exactly as the engine would have added them step by
    step; FINAL_MARK -- the first `final_num_tokens` added, then finish() (a sequence that the
    engine ended: the token stop rules may leave its last token out of the text). An output's
    text is `text(start, end)` between its marks; the marks only grow, so the detokenizer runs
    over each token once whatever order the outputs are read in, and `char_ends` (the text's
    length after each token) turns any older mark back into a character offset.

    Threads: the engine thread appends to `token_ids` (the sequence's output_token_ids) and
    sets `final_num_tokens` before it hands out FINAL_MARK; readers detokenize under the lock
    and only ever read tokens below a mark already handed out.
    """

    __slots__ = ("detokenizer", "token_ids", "final_num_tokens", "char_ends", "_finished",
                 "_failed", "_lock")

    def __init__(self, detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> None:
        self.detokenizer = detokenizer
        self.token_ids = token_ids
        self.final_num_tokens: int | None = None
        self.char_ends = array("q", [len(detokenizer.text)])
        self._finished = False
        self._failed = False
        self._lock = threading.Lock()

    def text(self, start: int, end: int) -> str:
        """The text between marks `start` and `end` (start <= end)."""
        lock = self._lock
        lock.acquire()  # (not `with`: half the cost, once per output read)
        try:
            char_ends = self.char_ends
            if end == FINAL_MARK or end >= len(char_ends):
                self._advance(end)
            text = self.detokenizer.text
            # A mark past char_ends: detokenizing failed before it (the text stopped there).
            last = len(char_ends) - 1
            first_char = len(text) if start == FINAL_MARK or start > last else char_ends[start]
            end_char = len(text) if end == FINAL_MARK or end > last else char_ends[end]
            return text[first_char:end_char]
        finally:
            lock.release()

    def _advance(self, mark: int) -> None:
        """Detokenize up to `mark`."""
        if self._finished or self._failed:
            return
        num_tokens = self.final_num_tokens if mark == FINAL_MARK else mark
        detokenizer, char_ends, token_ids = self.detokenizer, self.char_ends, self.token_ids
        try:
            for i in range(len(char_ends) - 1, num_tokens):
                detokenizer.add_token(token_ids[i])
                char_ends.append(len(detokenizer.text))
            if mark == FINAL_MARK:
                detokenizer.finish()
                self._finished = True
        except Exception:  # noqa: BLE001 -- a reader must not fail for the tokenizer's fault
            # Inside the engine this failed the request; out here its tokens are already out.
            # The text stops where it was, for this output and every later one.
            log.exception("detokenizing deferred text failed; the text stops here")
            self._failed = True


class TokenTexts:
    """`decoded_token` of logprob entries: tokenizer.decode([id]) (special tokens kept, as
    vLLM's convert_ids_list_to_tokens does), cached per id -- top-k lists repeat the same few
    ids every step, and the cache is bounded by the vocabulary. None without a tokenizer."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def position_logprobs(entry: TokenLogprobs,
                      token_text: Callable[[int], str | None]) -> PositionLogprobs:
    """One position's {token_id: Logprob} (vLLM's shape): the sampled (or prompt) token first,
    with its rank, then the top-k with ranks 1..k. A token that is both keeps its first place
    and takes the top-k entry (as a dict built in that order does in vLLM)."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, token_text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs),
                                               start=1):
        out[token_id] = Logprob(logprob, rank, token_text(token_id))
    return out
