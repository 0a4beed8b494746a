"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

A GGUF's `tokenizer.chat_template` is untrusted input, so it runs in Jinja2's immutable sandbox, with
the time and size limits of template_sandbox.py. The environment mirrors transformers 5.x
(`utils/chat_template_utils.py`): `trim_blocks`/`lstrip_blocks`,
the loop-controls extension, a `tojson` that is plain `json.dumps` (no key sorting, no HTML escaping,
non-ASCII kept), the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that refuses
`_`-prefixed attributes, the same message preprocessing (None-valued keys dropped; `reasoning_content` /
`thinking` / `reasoning` aliased to one another) and the refusal of an empty conversation.
tests/templates/test_transformers_parity.py checks this against transformers itself.
"""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from importlib.resources import files
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.utils import Namespace

from bubo.templates.template_sandbox import (
    GuardedEnvironment,
    RenderLimitError,
    RenderLimits,
    render_with_limits,
)

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ConversationTooLargeError",
    "RenderLimits",
    "TemplateSandboxError",
]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
DEFAULT_LIMITS = RenderLimits()


class ChatTemplateError(ValueError):
    """The template could not render this conversation (a syntax error, or its own raise_exception)."""


class TemplateSandboxError(ChatTemplateError):
    """The template tried something the sandbox forbids or broke a render limit: the model file is at
    fault, not the request."""


class ConversationTooLargeError(ChatTemplateError):
    """A render limit stopped the template on a conversation whose size explains it: the request is
    too large, not the template broken."""


# A conversation this much smaller than the render's size limit cannot reach it by its own size (nor,
# with the template doing a sane amount of work per character, its time limit): a template stopped on
# a smaller one is at fault itself.
_TEMPLATE_AMPLIFICATION = 16
# What a message costs a template beyond its text: its role, its layout, a pass of the loop.
_MESSAGE_CHARS = 64


def _conversation_chars(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> int:
    return sum(len(str(m.get("content") or "")) + _MESSAGE_CHARS for m in messages) + len(str(tools or ""))


class _GenerationTag(Extension):
    """transformers' `{% generation %}…{% endgeneration %}` marks assistant text for training masks;
    for rendering it is a no-op block."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """transformers' `dict` global: callable like `dict`, with `fromkeys`, and no other attribute (the
    builtin type would expose its unbound methods to the template)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(Namespace):
    """transformers' `namespace`: it refuses `_`-prefixed attributes, at creation and on `set ns._x`, so a
    template that stores one fails here as it fails there."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
            )


def _environment() -> GuardedEnvironment:
    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


def _preprocess(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys (so `content: null` reads as undefined) and alias the reasoning keys.

    As transformers does it, key order included (a template may `tojson` a whole message): the first of
    `reasoning_content` / `thinking` / `reasoning` becomes `reasoning_content` (set last), and `thinking`
    is added in front unless the message already has its own."""
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_KEYS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """One compiled template plus the special-token strings it may refer to (`bos_token`, …)."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        limits: RenderLimits = DEFAULT_LIMITS,
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"the chat template does not parse: {error} (line {error.lineno})"
            ) from None
        except (RecursionError, MemoryError) as error:
            raise ChatTemplateError(f"the chat template is too deeply nested to compile ({error})") from None

    @classmethod
    def fallback(cls, special_tokens: Mapping[str, str] | None = None) -> "ChatTemplate":
        """ChatML, for files that carry no template of their own."""
        return cls(files("bubo.templates").joinpath("chatml.jinja").read_text(), special_tokens)

    @cached_property
    def supports_thinking(self) -> bool:
        """Whether the template knows reasoning blocks (Qwen3's `<think>` or an enable_thinking switch)."""
        return "<think>" in self.source or "enable_thinking" in self.source

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders the `tools` it is given (else they go into the system prompt)."""
        return "tools" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; extra kwargs (enable_thinking, …) become template variables.

        An empty conversation is refused, as transformers refuses it, whatever the template would do."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": [_preprocess(m) for m in messages],
            "tools": list(tools) if tools is not None else None,
            "documents": list(documents) if documents is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return render_with_limits(lambda: self._template.generate(**variables), self.limits)
        except RenderLimitError as error:
            if _conversation_chars(messages, tools) * _TEMPLATE_AMPLIFICATION >= self.limits.max_chars:
                raise ConversationTooLargeError(
                    f"the conversation is too large to render ({error}); shorten it"
                ) from None
            raise TemplateSandboxError(str(error)) from None
        except SecurityError as error:
            raise TemplateSandboxError(
                f"the chat template tried something the sandbox forbids: {error}"
            ) from None
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as error:
            raise ChatTemplateError(f"the chat template failed on this conversation: {error}") from None
        except OverflowError as error:  # the sandbox's range() limit among others
            raise TemplateSandboxError(f"the chat template went over a sandbox limit: {error}") from None
        except Exception as error:
            raise TemplateSandboxError(f"the chat template failed: {type(error).__name__}: {error}") from None
