"""Admission checks of one request that need the model: vLLM's SamplingParams.verify and
update_from_tokenizer, prompt truncation, and chat rendering (LLMEngine.add_request's steps
after SamplingParams.validate). Each failure is a RequestError with vLLM's message where vLLM
has one; nothing here touches engine state.
"""
from __future__ import annotations

from typing import Any

from pagedrun.runtime.chat_options import ChatOptions, ChatOptionsError
from pagedrun.runtime.errors import ERR_INVALID, RequestError
from pagedrun.runtime.sampling_params import SamplingParams


def render_chat(tokenizer: Any, messages: list[dict], chat_options) -> list[int]:
    """The prompt ids of a chat: the template (the model's or the request's own) rendered with
    the request's chat options (a ChatOptions, a dict of its fields, or None)."""
    try:
        options = (chat_options if isinstance(chat_options, ChatOptions)
                   else ChatOptions(**(chat_options or {})))
        options.validate()
    except (ChatOptionsError, TypeError) as exc:
        raise RequestError(ERR_INVALID, f"chat options: {exc}") from None
    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True,
                                                  **options.template_kwargs()))
    except Exception as exc:  # template errors are the user's messages' fault
        raise RequestError(ERR_INVALID, f"chat template: {exc}") from None


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` prompt tokens (vLLM's truncate_prompt_tokens; -1: max_model_len), cut
    before the length checks."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    elif keep > max_model_len:
        raise RequestError(ERR_INVALID, f"truncate_prompt_tokens ({keep}) is greater than "
                                        f"max_model_len ({max_model_len})")
    return token_ids[-keep:]


def verify_params(params: SamplingParams, vocab: int, max_logprobs: int, tokenizer) -> None:
    """vLLM's SamplingParams.verify and update_from_tokenizer: the checks that need the model.
    Sets params._bad_words_token_ids (params must be the request's own copy). max_logprobs:
    EngineConfig.max_logprobs (-1: the vocabulary)."""
    def out_of_vocab(ids) -> list[int]:
        return [t for t in ids if not 0 <= t < vocab]

    for name in ("stop_token_ids", "logit_bias"):
        bad = out_of_vocab(getattr(params, name) or ())
        if bad:
            raise RequestError(ERR_INVALID, f"token_id(s) {bad} in {name} contain "
                                            f"out-of-vocab token ids. Vocabulary size: {vocab}")
    if params.allowed_token_ids is not None and out_of_vocab(params.allowed_token_ids):
        raise RequestError(ERR_INVALID, "allowed_token_ids contains out-of-vocab token id!")
    limit = vocab if max_logprobs == -1 else max_logprobs
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, name)
        num = vocab if asked == -1 else asked
        if num is not None and num > limit:
            raise RequestError(ERR_INVALID, f"Requested {kind} logprobs of {num}, which is "
                                            f"greater than max allowed: {limit}")
    if params.stop and tokenizer is None:
        raise RequestError(ERR_INVALID, "stop strings need a tokenizer; use stop_token_ids")
    params._bad_words_token_ids = (bad_words_token_ids(tokenizer, params.bad_words, vocab)
                                   if params.bad_words else None)


def bad_words_token_ids(tokenizer, bad_words: list[str], vocab: int) -> list[list[int]]:
    """Token ids of each bad word (vLLM's update_from_tokenizer): the word as written (leading
    spaces stripped) always; with one leading space too when that spells a different first
    token in as many tokens (a word at the start of the text and the same word mid-text are
    different tokens in most BPE vocabularies)."""
    if tokenizer is None:
        raise RequestError(ERR_INVALID, "bad_words need a tokenizer; use logit_bias or "
                                        "allowed_token_ids")
    out: list[list[int]] = []
    for word in bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise RequestError(ERR_INVALID,
                               "bad_words entries must tokenize to at least one token.")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = [t for ids in out for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(ERR_INVALID, f"bad_words tokenize to token ids {bad} outside the "
                                        f"model's vocabulary of {vocab}")
    return out
