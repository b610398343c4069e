"""Stop conditions of one generated sequence, checked by the engine after every sampled token.

Order of the checks (each later one only if no earlier one fired):
  1. fewer than `min_tokens` generated: never stop (EOS, stop ids and stop strings are ignored);
  2. EOS (unless `ignore_eos`) -> "stop", stop_reason None;
  3. a `stop_token_ids` member -> "stop", stop_reason = that id;
  4. a stop string in the detokenized text -> "stop", stop_reason = the string; the text is cut
     at the match start (or its end with `include_stop_str_in_output`), so no output ever holds
     text past a stop string;
  5. `max_tokens` generated, or the sequence reached `max_model_len` -> "length".

Stop strings are searched only in the window the newest characters can complete (the new text
plus the longest stop string's length minus one before it), so the check costs O(new text)
per step even for long outputs, and a stop string spanning token boundaries is still found.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedrun.runtime.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass
class StopDecision:
    finish_reason: str | None = None  # None: keep generating
    stop_reason: int | str | None = None
    # Where the visible text ends (a cut at a stop string); None: keep the whole text.
    text_end: int | None = None


def find_stop_string(text: str, num_new_chars: int, stop: list[str],
                     include_stop_str: bool) -> tuple[str, int] | None:
    """Earliest stop string completed by the last `num_new_chars` characters of `text`.

    Returns (stop string, visible text end) or None.
    """
    if not stop or num_new_chars <= 0:
        return None
    longest = max(len(s) for s in stop)
    window_start = max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in stop:
        idx = text.find(s, window_start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, (idx + len(s) if include_stop_str else idx)


def check_stop(params: SamplingParams, token_id: int, num_output_tokens: int, num_total_tokens: int,
               text: str, num_new_chars: int, eos_token_ids: frozenset[int],
               max_model_len: int) -> StopDecision:
    """Decide whether a sequence stops after appending `token_id` (already counted in the sizes).

    `num_total_tokens` is prompt plus output; `text` is the whole detokenized output so far and
    `num_new_chars` how much of it this token added.
    """
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return StopDecision(FINISH_STOP, None)
        if token_id in params.stop_token_ids:
            return StopDecision(FINISH_STOP, token_id)
        hit = find_stop_string(text, num_new_chars, params.stop, params.include_stop_str_in_output)
        if hit is not None:
            return StopDecision(FINISH_STOP, hit[0], hit[1])
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return StopDecision(FINISH_LENGTH)
    if num_total_tokens >= max_model_len:
        return StopDecision(FINISH_LENGTH)
    return StopDecision()


def stream_holdback_chars(params: SamplingParams) -> int:
    """Characters a running sequence keeps back from its streamed text.

    The tail of the text could be the start of a stop string that the next token completes;
    streaming it would show text the final output will not contain.
    """
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1
