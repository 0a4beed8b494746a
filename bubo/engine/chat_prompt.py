"""A chat made ready to run, the one way the server's chat routes and `Model.chat` both take: the
model's chat template (`chat_template`), the prompt it renders (`ChatPrompter.render`, `.prompt`), and
what the answer is held to (`ChatPrompter.prepare`: the tool-call parser where tools are offered, the
grammar that forces a call or a JSON answer, the reasoning budget).

A request the template cannot take is a RequestError; a template that the sandbox stops
(TemplateSandboxError) is the model file's fault, not the request's, and is left for the caller to
report as such.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bubo.engine.chat_messages import text_only, without_image_sources
from bubo.engine.chat_request import ChatRequest
from bubo.engine.grammar import GrammarMatcher
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.output_format import OutputConstraint
from bubo.engine.output_grammar import GrammarCompiler, forces_tool_call
from bubo.engine.prompt_images import PromptImage
from bubo.engine.request_error import RequestError, invalid_field
from bubo.model.tokenizer import Tokenizer
from bubo.templates.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ConversationTooLargeError,
    TemplateSandboxError,
)
from bubo.templates.tool_calls import ToolCallParser, tool_call_format
from bubo.templates.tool_prompt import with_tools_in_messages

__all__ = ["ChatPrompter", "ImagePlacer", "PreparedChat", "RenderedPrompt", "chat_template", "prompt_tokens"]

log = logging.getLogger("bubo.engine")

# Puts a prompt's images in its tokens: each image's pad token repeated once per token the vision tower
# gives it; returns the tokens and where each image sits.
ImagePlacer = Callable[[list[int]], tuple[list[int], tuple[PromptImage, ...]]]


def chat_template(loaded: LoadedModel) -> ChatTemplate:
    """The file's chat template, or the ChatML fallback where it has none or one that does not compile."""
    tokenizer = loaded.tokenizer
    special = {
        name: tokenizer.decode([token_id])
        for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
        if token_id is not None
    }
    source = loaded.file.metadata.get("tokenizer.chat_template")
    try:
        return ChatTemplate(source, special) if isinstance(source, str) else ChatTemplate.fallback(special)
    except ChatTemplateError as error:
        log.warning("%s; using the ChatML fallback", error)
        return ChatTemplate.fallback(special)


def prompt_tokens(tokenizer: Tokenizer, text: str, *, parse_special: bool = True) -> list[int]:
    """Prompt tokens; BOS as the file says, unless the text already starts with it (templates that
    write `bos_token` themselves would otherwise get two)."""
    ids = tokenizer.encode(text, parse_special=parse_special)
    bos = tokenizer.bos_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat rendered by the template: the text, its tokens, and where reasoning stands at its end."""

    text: str
    ids: list[int]
    reasoning: bool
    in_reasoning: bool
    images: tuple[PromptImage, ...] = ()


@dataclass(frozen=True)
class PreparedChat:
    """A chat ready to become a generation request: its prompt, the parser that turns the answer's
    tool-call markup into calls (where tools are offered), the grammar the answer is held to, and the
    reasoning budget (None: no limit)."""

    prompt: RenderedPrompt
    tool_parser: ToolCallParser | None
    grammar: GrammarMatcher | None
    reasoning_budget: int | None


class ChatPrompter:
    """One model's chat template and tokenizer; `vision` whether the model takes images (a vision
    tower is loaded), without which an image part is refused."""

    def __init__(
        self, template: ChatTemplate, tokenizer: Tokenizer, vocab_size: int, *, vision: bool = False
    ) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        self.vision = vision

    def render(self, chat: ChatRequest) -> str:
        """The prompt text of a chat, exactly as generation uses it."""
        kwargs: dict[str, Any] = dict(chat.template_kwargs)
        if chat.thinking.enabled is not None:
            kwargs["enable_thinking"] = chat.thinking.enabled
        if chat.thinking.effort is not None:
            kwargs["reasoning_effort"] = chat.thinking.effort
        tools = chat.tools if chat.tool_choice.mode != "none" else None
        images = chat.images
        if images and not self.vision:
            raise text_only(images[0])
        messages = without_image_sources(chat.messages) if images else chat.messages
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if uses_tools and not self.template.supports_tools:
            messages, tools = with_tools_in_messages(messages, tools), None
        prefill = _prefill(chat.messages)
        try:
            text = self.template.render(
                messages,
                tools=tools,
                add_generation_prompt=chat.add_generation_prompt and prefill is None,
                **kwargs,
            )
        except ConversationTooLargeError as error:
            raise RequestError(str(error), code="context_length_exceeded") from None
        except TemplateSandboxError:
            raise
        except ChatTemplateError as error:
            raise RequestError(str(error), code="template_error") from None
        if prefill is None:
            return text
        # The template closes the final turn; the answer continues its text instead (transformers'
        # continue_final_message: cut after the last place the text appears).
        end = text.rfind(prefill)
        if end < 0:
            raise invalid_field(
                f"messages[{len(chat.messages) - 1}].content",
                "is a final assistant message to continue, but the chat template does not write it as given",
            )
        return text[: end + len(prefill)]

    def prompt(self, chat: ChatRequest, place_images: ImagePlacer | None = None) -> RenderedPrompt:
        """The chat's prompt text and tokens. With `place_images` (for the chat's images, decoded), each
        image's pad token is expanded to the tower's tokens; without, an image is the one pad token the
        template wrote (what /apply-template and /debug/prompt show)."""
        text = self.render(chat)
        thinking = self.template.supports_thinking and chat.thinking.enabled is not False
        opened = text.rstrip().endswith("<think>")
        ids = prompt_tokens(self.tokenizer, text)
        placed: tuple[PromptImage, ...] = ()
        if place_images is not None and chat.images:
            ids, placed = place_images(ids)
        return RenderedPrompt(text, ids, reasoning=thinking or opened, in_reasoning=opened, images=placed)

    def compiles_grammar(self, chat: ChatRequest, constraint: OutputConstraint | None) -> bool:
        """Whether `prepare` compiles a grammar (which can take seconds: the server runs it off its
        event loop)."""
        return constraint is not None or forces_tool_call(chat)

    def prepare(
        self,
        chat: ChatRequest,
        constraint: OutputConstraint | None = None,
        place_images: ImagePlacer | None = None,
    ) -> PreparedChat:
        """The chat's prompt, its tool-call parser when tools are offered (and not switched off by
        tool_choice "none"), and the grammar of a forced call (tool_choice "required" or a named tool)
        or of the output `constraint` (a JSON schema or a GBNF grammar the request asked for)."""
        prompt = self.prompt(chat, place_images)
        parser = None
        grammar = None
        if chat.tools and chat.tool_choice.mode != "none":
            calls = tool_call_format(self.template.source if self.template.supports_tools else "")
            parser = ToolCallParser(calls, chat.tools, parallel=chat.tool_choice.parallel)
            grammar = self.grammars.chat(chat, calls, constraint)
        else:
            grammar = self.grammars.constraint(constraint)
        return PreparedChat(prompt, parser, grammar, chat.thinking.budget)


def _prefill(messages: Sequence[dict[str, Any]]) -> str | None:
    """The text of a final assistant message to continue, as Anthropic's Messages API and llama-server
    do with one (a prefill: the answer starts with it): a text answer without tool calls, stripped as
    templates strip it. None when the chat ends otherwise."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or final.get("tool_calls") or not isinstance(content, str):
        return None
    return content.strip() or None
