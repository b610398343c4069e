"""ChatOptions: how a chat request's messages become a prompt (vLLM's chat keywords).

`LLM.chat(..., chat_template=, add_generation_prompt=, continue_final_message=, tools=,
chat_template_kwargs=)` and the protocol's GENERATE fields of the same names build one; the
engine hands it to `Tokenizer.apply_chat_template`. Plain data, validated here, so every entry
point refuses the same things with the same message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# Size limits, the same on every path (GENERATE, /tokenize, LLM.chat): a request's own template
# is compiled (cached by source) and rendered per request, so its size bounds that work (real
# templates, tools included, are under 16 KiB); the jinja sandbox bounds what it can reach.
MAX_CHAT_TEMPLATE_CHARS = 32768
MAX_TOOLS = 128
MAX_CHAT_TEMPLATE_KWARGS = 64


class ChatOptionsError(ValueError):
    """A chat option is invalid; the message names it."""


@dataclass
class ChatOptions:
    chat_template: str | None = None  # a Jinja template that replaces the model's
    add_generation_prompt: bool = True
    # Render the last (assistant) message open-ended, so generation continues it.
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # the template's `tools` variable
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # more template variables

    def __post_init__(self) -> None:
        if self.chat_template_kwargs is None:
            self.chat_template_kwargs = {}
        self.validate()

    def validate(self) -> None:
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ChatOptionsError("chat_template: must be a string")
        if self.chat_template is not None and len(self.chat_template) > MAX_CHAT_TEMPLATE_CHARS:
            raise ChatOptionsError(f"chat_template: at most {MAX_CHAT_TEMPLATE_CHARS} characters, "
                                   f"got {len(self.chat_template)}")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ChatOptionsError(f"{name}: must be a boolean")
        if self.add_generation_prompt and self.continue_final_message:
            # vLLM's message (vllm/entrypoints/chat_utils.py).
            raise ChatOptionsError("continue_final_message and add_generation_prompt "
                                   "cannot both be True.")
        if self.tools is not None and not (isinstance(self.tools, list) and all(
                isinstance(t, dict) for t in self.tools)):
            raise ChatOptionsError("tools: must be a list of maps")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise ChatOptionsError(f"tools: at most {MAX_TOOLS} tools, got {len(self.tools)}")
        if not isinstance(self.chat_template_kwargs, dict) or not all(
                isinstance(k, str) for k in self.chat_template_kwargs):
            raise ChatOptionsError("chat_template_kwargs: must be a map with string keys")
        if len(self.chat_template_kwargs) > MAX_CHAT_TEMPLATE_KWARGS:
            raise ChatOptionsError(f"chat_template_kwargs: at most {MAX_CHAT_TEMPLATE_KWARGS} "
                                   f"entries, got {len(self.chat_template_kwargs)}")
        reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools",
                    "tokenize", "chat_template"}
        clash = sorted(reserved & set(self.chat_template_kwargs))
        if clash:
            raise ChatOptionsError(f"chat_template_kwargs: {', '.join(clash)} have their own "
                                   "options")

    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of Tokenizer.apply_chat_template these options stand for (the
        engine and the server render with this one mapping)."""
        return dict(add_generation_prompt=self.add_generation_prompt,
                    chat_template=self.chat_template,
                    continue_final_message=self.continue_final_message, tools=self.tools,
                    **self.chat_template_kwargs)
