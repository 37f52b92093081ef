"""A model's chat template: Jinja source from the model file, rendered in a sandbox the way Hugging
Face's `apply_chat_template(..., tokenize=False)` renders it, so a prompt built here is the prompt
the reference implementation would build."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; templates read `reasoning_content` (most) or `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or could not be compiled/rendered."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    only needs its body, but templates that use it must still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>` and `&`, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _with_reasoning_aliases(message: Mapping[str, Any]) -> dict[str, Any]:
    message = copy.deepcopy(dict(message))
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message.setdefault("thinking", reasoning)
        message["reasoning_content"] = reasoning
    return message


class ChatTemplate:
    """A compiled chat template. Rendering never mutates the caller's messages."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str], **kwargs: Any) -> str:
        """`special_tokens` are the named tokens (`bos_token`, `eos_token`, ...) templates may use;
        `kwargs` (tools, documents, enable_thinking, ...) override them, as in Hugging Face."""
        variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
        variables["messages"] = [_with_reasoning_aliases(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
