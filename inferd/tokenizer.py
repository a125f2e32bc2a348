"""The tokenizer the engine uses: a ``tokenizers.Tokenizer`` plus what a model
adds to it (BOS/EOS, special ids, the chat template).

Chat templates render as transformers renders them: Jinja2 in an immutable
sandbox with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, and the helpers templates expect (``raise_exception``, a
``tojson`` that keeps non-ASCII text, ``strftime_now``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """Raised by a template's ``raise_exception`` (e.g. "roles must alternate")."""


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        add_bos_token: bool = False,
        name: str = "",
    ) -> None:
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._backend = backend
        self.bos_token_id = self._required_id(bos_token, "bos_token")
        if add_bos_token and self.bos_token_id is None:
            raise ValueError(f"tokenizer {name!r}: add_bos_token is set but there is no bos_token")
        self.add_bos_token = add_bos_token
        eos_id = self._required_id(eos_token, "eos_token")
        self.eos_token_ids = frozenset(eos_token_ids) | ({eos_id} if eos_id is not None else set())
        size = self.vocab_size
        if any(not 0 <= i < size for i in self.eos_token_ids):
            raise ValueError(f"tokenizer {name!r}: eos_token_ids {sorted(self.eos_token_ids)} not all in [0, {size})")
        added = backend.get_added_tokens_decoder()
        special = {i for i, token in added.items() if token.special} | self.eos_token_ids
        if self.bos_token_id is not None:
            special.add(self.bos_token_id)
        self.all_special_ids = frozenset(special)
        self._template: jinja2.Template | None = None

    def _required_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer {self.name!r}: {field} {token!r} is not in the vocabulary")
        return token_id

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # A tokenizer.json post-processor may already have added BOS.
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(i) if 0 <= i < self.vocab_size else None

    def token_to_id(self, s: str) -> int | None:
        return self._backend.token_to_id(s)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as the model's prompt text (special tokens spelled out)."""
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
        conversation = _normalize_messages(messages)
        if self._template is None:
            self._template = self._compile()
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        # As in transformers, `documents` is always defined (None unless given).
        variables = {k: v for k, v in variables.items() if v is not None} | {"documents": None} | kwargs
        try:
            return self._template.render(
                messages=conversation, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # the template is the model's code: any error it makes is a bad input
            raise ValueError(f"chat template of {self.name!r} failed: {type(e).__name__}: {e}") from e

    def _compile(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(f"model {self.name!r} has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.name!r} does not parse: {e}") from e


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages, each content a string (text parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        elif content is None:
            # An assistant turn that only calls tools may carry no content.
            if not message.get("tool_calls"):
                raise ValueError(f"messages[{i}].content is required")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**message, "content": content})
    return out


def _text_part(part: Any, i: int, j: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f'messages[{i}].content[{j}] must be {{"type": "text", "text": <string>}}')
    return part["text"]


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's part of
    a training template; for inference it renders just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)
