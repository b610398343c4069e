"""Prompt inputs: every prompt form the vLLM-named entry points take, turned into the engine's
one internal form, a PromptInput (prompt text | prompt token ids | chat messages).

The forms are vLLM's `PromptType` (vllm/inputs/data.py): a string; a list of token ids; a
TextPrompt `{"prompt": str}`; a TokensPrompt `{"prompt_token_ids": [int, ...]}` (optionally
with the text it stands for under "prompt"). A batch is any list or tuple of those, mixed
freely; one string, one dict or one non-empty list of ints is a batch of one (vLLM's
prompt_to_seq). Chat input is one conversation (a list of message dicts) or a list of them.

What this engine cannot serve is refused here with a message that names the prompt and the
key, never dropped: multi-modal data, prompt embeddings, encoder/decoder pairs, token type
ids, a per-request cache salt. Checks that need the model (ids within the vocabulary, the
length) stay at admission (LLMEngine.add_request), where every entry point meets them.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Keys of vLLM's prompt dicts this engine serves.
TEXT_PROMPT_KEY = "prompt"
TOKENS_PROMPT_KEY = "prompt_token_ids"

# Keys of vLLM's prompt dicts this engine cannot serve, and why (the refusal's message).
_MULTI_MODAL = "multi-modal inputs are not supported: this engine serves text-only models"
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": _MULTI_MODAL,
    "mm_processor_kwargs": _MULTI_MODAL,
    "multi_modal_uuids": _MULTI_MODAL,
    "prompt_embeds": "embedding prompts (EmbedsPrompt) are not supported; send text or token ids",
    "encoder_prompt": "encoder/decoder prompts are not supported: the models served here are "
                      "decoder-only",
    "decoder_prompt": "encoder/decoder prompts are not supported: the models served here are "
                      "decoder-only",
    "token_type_ids": "token_type_ids are for cross-encoder (scoring) models, not served here",
    "cache_salt": "a per-request cache_salt is not supported (the engine keeps its own prefix-"
                  "cache salts); leave it out",
    "data": "IO-processor plugin prompts (DataPrompt) are not supported",
}

# How the text parts of a message's content become what the chat template sees (vLLM's
# chat_template_content_format). "string": one string, the parts joined by a newline (vLLM's
# joiner); "openai": the list of parts, as given. "auto" is "string" here (vLLM inspects the
# template to choose; docs/engine_api.md lists the difference).
CONTENT_FORMATS = ("auto", "string", "openai")
CONTENT_PART_JOINER = "\n"


class PromptInputError(ValueError):
    """A prompt (or conversation) is not in a form the engine takes; the message names it."""


@dataclass(frozen=True)
class PromptInput:
    """One request's prompt, in exactly one of the engine's three forms. `prompt` may come
    with `prompt_token_ids` (a TokensPrompt that carries its text): the ids are what runs, the
    text is only reported back (RequestOutput.prompt)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The one prompt keyword of LLMEngine.add_request this input stands for."""
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids}
        if self.messages is not None:
            return {"messages": self.messages}
        return {"prompt": self.prompt}


def parse_prompt(prompt: Any, where: str = "prompt") -> PromptInput:
    """One vLLM SingletonPrompt (str, list of ints, TextPrompt or TokensPrompt dict)."""
    if isinstance(prompt, str):
        return PromptInput(prompt=prompt)
    if isinstance(prompt, Mapping):
        return _parse_prompt_dict(prompt, where)
    if isinstance(prompt, (list, tuple)):
        return PromptInput(prompt_token_ids=token_id_list(prompt, where))
    raise PromptInputError(f"{where}: must be a string, a list of token ids, or a dict with "
                           f"'prompt' or 'prompt_token_ids'; got {type(prompt).__name__}")


def parse_prompts(prompts: Any) -> list[PromptInput]:
    """One prompt or a batch (vLLM's PromptType | Sequence[PromptType]), as a list."""
    if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
        return [parse_prompt(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise PromptInputError(f"prompts: must be a prompt or a list of prompts; got "
                               f"{type(prompts).__name__}")
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def parse_conversations(messages: Any, content_format: str = "auto") -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of conversations (vLLM's
    conversation_to_seq), each checked and its content put in `content_format`."""
    if content_format not in CONTENT_FORMATS:
        raise PromptInputError(f"chat_template_content_format: must be one of "
                               f"{', '.join(CONTENT_FORMATS)}; got {content_format!r}")
    if not isinstance(messages, (list, tuple)):
        raise PromptInputError(f"messages: must be a list of messages or a list of "
                               f"conversations; got {type(messages).__name__}")
    if messages and all(isinstance(m, Mapping) for m in messages):
        return [_conversation(messages, "messages", content_format)]
    return [_conversation(c, f"messages[{i}]", content_format) for i, c in enumerate(messages)]


def resolve_request_prompt(prompt: Any = None, prompt_token_ids: Any = None,
                           messages: Any = None) -> PromptInput:
    """LLMEngine.add_request's prompt arguments as one PromptInput: `prompt` may be any vLLM
    SingletonPrompt (vLLM's positional `add_request(request_id, prompt, params)`), or the
    engine's own keywords give text, ids or messages; exactly one of the three is given."""
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise PromptInputError("give exactly one of prompt, prompt_token_ids, messages"
                               + (f" (got {', '.join(given)})" if given else ""))
    if prompt is not None:
        return parse_prompt(prompt)
    if prompt_token_ids is not None:
        return PromptInput(prompt_token_ids=token_id_list(prompt_token_ids, "prompt_token_ids"))
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping)
                                                          for m in messages):
        raise PromptInputError("messages: must be a list of message dicts")
    return PromptInput(messages=list(messages))


def token_id_list(values: Any, where: str) -> list[int]:
    """`values` (a list or tuple, or a 1-D integer numpy array: the engine's keyword has
    always taken one) as a list of Python ints; bools, floats and anything else are refused,
    naming the first offending position."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise PromptInputError(f"{where}: a numpy array of token ids must be 1-D with an "
                                   f"integer dtype, got {values.ndim}-D {values.dtype}")
        return values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise PromptInputError(f"{where}: must be a list of token ids (ints)")
    if set(map(type, values)) <= {int}:  # the common case, checked at C speed (bool is not int)
        return list(values)
    ids = []
    for j, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PromptInputError(f"{where}[{j}]: a token id must be an int, got "
                                   f"{type(value).__name__}")
        ids.append(int(value))
    return ids


def _is_token_list(value: Any) -> bool:
    """One token-id prompt given bare: a non-empty list (or tuple) of ints."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    if set(map(type, value)) <= {int}:  # the common case, checked at C speed
        return True
    return all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value)


def _parse_prompt_dict(prompt: Mapping, where: str) -> PromptInput:
    for key in prompt:
        if not isinstance(key, str):
            raise PromptInputError(f"{where}: keys must be strings, got {key!r}")
    for key, reason in UNSUPPORTED_PROMPT_KEYS.items():
        # A key present with the value None is "not given" (code that builds the dict
        # generically); any other value is refused.
        if prompt.get(key) is not None:
            raise PromptInputError(f"{where}[{key!r}]: {reason}")
    known = {TEXT_PROMPT_KEY, TOKENS_PROMPT_KEY, *UNSUPPORTED_PROMPT_KEYS}
    unknown = sorted(set(prompt) - known)
    if unknown:
        raise PromptInputError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a "
                               "prompt dict has 'prompt' (TextPrompt) or 'prompt_token_ids' "
                               "(TokensPrompt)")
    text = prompt.get(TEXT_PROMPT_KEY)
    if text is not None and not isinstance(text, str):
        raise PromptInputError(f"{where}['prompt']: must be a string, got "
                               f"{type(text).__name__}")
    token_ids = prompt.get(TOKENS_PROMPT_KEY)
    if token_ids is not None:
        ids = token_id_list(token_ids, f"{where}['prompt_token_ids']")
        return PromptInput(prompt=text, prompt_token_ids=ids)
    if text is None:
        raise PromptInputError(f"{where}: a prompt dict needs 'prompt' (a string) or "
                               "'prompt_token_ids' (a list of ints)")
    return PromptInput(prompt=text)


def _conversation(messages: Any, where: str, content_format: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PromptInputError(f"{where}: a conversation must be a non-empty list of message "
                               "dicts")
    out = []
    for i, message in enumerate(messages):
        here = f"{where}[{i}]"
        if not isinstance(message, Mapping):
            raise PromptInputError(f"{here}: a message must be a dict with 'role' and "
                                   f"'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise PromptInputError(f"{here}['role']: must be a string")
        message = dict(message)  # the caller's dict is left alone
        if "content" in message:
            message["content"] = _content(message["content"], f"{here}['content']",
                                          content_format)
        out.append(message)
    return out


def _content(content: Any, where: str, content_format: str) -> Any:
    """A message's content: a string, None (an assistant turn that only calls tools), or a
    list of OpenAI-style text parts; other parts (images, audio, ...) are refused."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise PromptInputError(f"{where}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # vLLM takes a bare string as a text part
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in (None, "text"):
            raise PromptInputError(f"{where}[{j}]: a {kind!r} part: {_MULTI_MODAL}")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise PromptInputError(f"{where}[{j}]: a content part must be "
                                   "{'type': 'text', 'text': str}")
        texts.append(part["text"])
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return CONTENT_PART_JOINER.join(texts)
