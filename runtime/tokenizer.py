"""`Tokenizer`: a model directory's tokenizer.json plus its chat template, as transformers uses
them.

Owns text <-> token ids for one model: `encode`/`decode` delegate to the `tokenizers` library
(the post-processor in tokenizer.json decides which special tokens `add_special_tokens=True`
adds, exactly as transformers' fast tokenizers do), and `apply_chat_template` renders the
model's Jinja chat template the way transformers renders it: a sandboxed, immutable environment
with `trim_blocks` and `lstrip_blocks`, the loop-controls extension, `raise_exception`,
`strftime_now`, a `tojson` filter that keeps non-ASCII text, and the special tokens
(`bos_token`, `eos_token`, `unk_token`, `pad_token`) as template variables.

Not done: transformers' optional `clean_up_tokenization_spaces` rewrite of decoded text (off for
every model we convert; it would also break incremental detokenization's prefix property).
"""
from __future__ import annotations

import json
import os
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Sequence

from pagedrun.runtime.errors import ModelLoadError, PagedRunError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Newer Hugging Face checkpoints keep the template in its own file; it wins over the config's.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

Message = dict[str, Any]


class ChatTemplateError(PagedRunError, ValueError):
    """The model has no chat template, or its template rejected the messages (the CLI prints
    it as a one-line error; a ValueError for callers that validate input)."""


class Tokenizer:
    """Text <-> token ids and chat formatting for one model directory."""

    def __init__(self, backend: Any, config: dict[str, Any],
                 chat_template: str | None = None) -> None:
        """backend: a `tokenizers.Tokenizer`; config: tokenizer_config.json's contents."""
        self.backend = backend
        self.config = config
        self.chat_template = (chat_template if chat_template is not None
                              else _config_template(config))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja`."""
        from tokenizers import Tokenizer as BackendTokenizer

        path = Path(path)
        tokenizer_path = path / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ModelLoadError(tokenizer_path, "file not found")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ModelLoadError(tokenizer_path, f"cannot load tokenizer: {exc}") from None
        config: dict[str, Any] = {}
        config_path = path / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(config_path, f"cannot parse: {exc}") from None
            if not isinstance(config, dict):
                raise ModelLoadError(config_path, "expected a JSON object")
        template_path = path / CHAT_TEMPLATE_FILE
        template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
        return cls(backend, config, template)

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_token(self, key: str) -> str | None:
        """The content of a special token named in tokenizer_config.json ("eos_token", ...)."""
        value = self.config.get(key)
        if isinstance(value, dict):  # serialized AddedToken
            value = value.get("content")
        return value if isinstance(value, str) else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        token = self.special_token("bos_token")
        return None if token is None else self.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        token = self.special_token("eos_token")
        return None if token is None else self.token_to_id(token)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of every added token marked special (what skip_special_tokens drops)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def is_chat_model(self) -> bool:
        return self.chat_template is not None

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched as tokens."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids` (invalid UTF-8 byte runs become U+FFFD, as in transformers)."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Returns the prompt text, or its ids when `tokenize` (encoded without adding special
        tokens, since the template writes them). `chat_template` replaces the model's template
        (compiled in the same sandboxed environment). `continue_final_message` leaves the last
        message open: the rendered text ends right after that message's content (what
        transformers does), so generation continues it. Extra keyword arguments (`tools`, ...)
        become template variables, as in transformers.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ChatTemplateError("this model has no chat template; use plain-text prompts")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot "
                                    "both be set")
        variables: dict[str, Any] = {key: self.special_token(key) for key in SPECIAL_TOKEN_KEYS}
        variables.update(template_kwargs)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        variables["messages"] = list(messages)
        variables["add_generation_prompt"] = add_generation_prompt
        template = compile_chat_template(source)
        try:
            text = template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 -- what the template did with these messages
            # An undefined callable, a sandbox refusal, 'a' + 1, a recursion: the template and
            # the request's messages and variables are the caller's, so the caller's error.
            raise ChatTemplateError(f"the chat template failed to render: "
                                    f"{type(exc).__name__}: {exc}"[:MAX_RENDER_ERROR_CHARS]) \
                from None
        if continue_final_message:
            text = cut_after_final_message(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def cut_after_final_message(text: str, messages: Sequence[Message]) -> str:
    """`text` (a rendered chat) cut right after the last message's content, dropping what the
    template appends to close the turn (an end-of-turn token, a newline).

    Templates may strip the content, so the last occurrence of the stripped content is found;
    the cut keeps the content's trailing whitespace only where the template kept it.
    """
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # content parts: continue the last text part
        texts = [part.get("text") for part in content
                 if isinstance(part, dict) and isinstance(part.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message: the final message has no text to "
                                "continue")
    core = content.strip()
    start = text.rfind(core)
    if not core or start == -1:
        raise ChatTemplateError("continue_final_message: the final message's content does not "
                                "appear in the rendered chat")
    tail = content.lstrip()
    end = start + (len(tail) if text.startswith(tail, start) else len(core))
    return text[:end]


def _config_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's template: a string, or a list of named ones ("default" wins)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default")
    return template if isinstance(template, str) else None


# Templates compiled per distinct source (the model's, and request overrides), so a request
# that names a template compiles it once, not every time.
COMPILED_TEMPLATE_CACHE_SIZE = 32
# Longest message of a render failure: the exception's text can quote hostile values.
MAX_RENDER_ERROR_CHARS = 300


@lru_cache(maxsize=COMPILED_TEMPLATE_CACHE_SIZE)
def compile_chat_template(source: str) -> Any:
    """A jinja2 Template for `source`, in an environment that renders as transformers does
    (sandboxed and immutable: a request's own template cannot reach Python objects)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes HTML characters and sorts keys; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from None
