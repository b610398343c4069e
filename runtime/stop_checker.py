"""Stop conditions of one generated sequence, checked by the engine after every sampled token
(vLLM's rules: docs/engine_api.md "vLLM conformance").

Two checks, in this order, each on its own input:

`check_token_stop` -- on the token alone, BEFORE it is detokenized (vLLM's
vllm/v1/core/sched/utils.py check_stop), each later rule only if no earlier one fired:
  1. `max_tokens` generated, or prompt + output reached `max_model_len` -> "length" (first:
     an EOS sampled as the last allowed token ends the sequence with "length");
  2. fewer than `min_tokens` generated -> keep going;
  3. EOS (unless `ignore_eos`) -> "stop", stop_reason None;
  4. a `stop_token_ids` member -> "stop", stop_reason = that id.
The engine then skips detokenizing a token that ended the sequence with "stop" unless
`include_stop_str_in_output` (its id stays in token_ids, its text never enters `text`).
`token_stop_bounds` reduces these rules to two tests per token (made once per request), so the
engine runs the check itself only on the few tokens that could end a sequence.

`find_stop_string` -- on the text the token added (vLLM's vllm/v1/engine/detokenizer.py
check_stop_strings), only once more than `min_tokens` tokens exist, and only for matches that
END in text produced after the min_tokens-th token. Stop strings are tried in the order of the
`stop` list and the first one found wins (not the earliest position: vLLM's rule, kept so that
the same request stops the same way here and there). The text is cut at the match start (or its
end with `include_stop_str_in_output`); a match turns the finish reason into "stop" with the
string as stop_reason, even on the token where rule 1 said "length".

A request without stop strings needs neither this check nor the text (`needs_text`): its
detokenization waits for whoever reads the output's text.

Each stop string is searched only in the window its match could end in (the new characters plus
its own length minus one before them), so the check costs O(new text) per step even for long
outputs, and a stop string spanning token boundaries is still found.
"""
from __future__ import annotations

from pagedrun.runtime.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


# check_token_stop's answers that carry no stop reason (made once: the check runs per token).
_STOP_LENGTH = (FINISH_LENGTH, None)
_STOP_EOS = (FINISH_STOP, None)


def check_token_stop(params: SamplingParams, token_id: int, num_output_tokens: int,
                     num_total_tokens: int, eos_token_ids: frozenset[int],
                     max_model_len: int) -> tuple[str, int | None] | None:
    """Whether the sequence ends on `token_id` (already counted in both sizes), from the token
    alone: (finish_reason, stop_reason), or None to keep generating. `num_total_tokens` is
    prompt plus output."""
    max_tokens = params.max_tokens
    if num_total_tokens >= max_model_len or (
            max_tokens is not None and num_output_tokens >= max_tokens):
        return _STOP_LENGTH
    if num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in eos_token_ids:
        return _STOP_EOS
    if params.stop_token_ids and token_id in params.stop_token_ids:
        return FINISH_STOP, token_id
    return None


def token_stop_bounds(params: SamplingParams, prompt_len: int, eos_token_ids: frozenset[int],
                      max_model_len: int) -> tuple[int, frozenset[int]]:
    """What `check_token_stop` needs of one sequence, made once per request so that the engine's
    per-token test is two comparisons: (length_limit, stop_ids). check_token_stop can answer
    anything but None only when `num_output_tokens >= length_limit` (max_tokens, or prompt +
    output reaching max_model_len) or `token_id in stop_ids` (EOS unless ignore_eos, and
    stop_token_ids); for a token passing neither the answer is None, and only the tokens that
    pass one need the full check (which applies min_tokens and the rules' order)."""
    length_limit = max_model_len - prompt_len
    if params.max_tokens is not None:
        length_limit = min(length_limit, params.max_tokens)
    stop_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
    if params.stop_token_ids:
        stop_ids |= frozenset(params.stop_token_ids)
    return length_limit, stop_ids


def find_stop_string(text: str, num_new_chars: int, stop: list[str],
                     include_stop_str: bool) -> tuple[str, int] | None:
    """The first string of `stop` (list order) with a match ending in the last `num_new_chars`
    characters of `text`. Returns (stop string, visible text end) or None."""
    if num_new_chars <= 0:
        return None
    for s in stop:
        idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if idx != -1:
            return s, (idx + len(s) if include_stop_str else idx)
    return None


def needs_text(params: SamplingParams) -> bool:
    """Whether the engine must detokenize a sequence as it goes: only its stop strings read
    the text. Without them the text waits until an output's `text` is read
    (detokenizer.DeferredText), and no text is held back from a stream."""
    return bool(params.stop)


def stream_holdback_chars(params: SamplingParams) -> int:
    """Characters a running sequence keeps back from its streamed text.

    The tail of the text could be the start of a stop string that the next token completes;
    streaming it would show text the final output will not contain. (With
    include_stop_str_in_output the cut falls after the stop string, so nothing streamed is
    ever taken back.)
    """
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1
