"""A chat's messages as the template sees them, whatever their dialect: OpenAI-style messages (role,
content, tool_calls, tool_call_id, reasoning_content) checked, their text parts joined, their image
parts kept in place as neutral `ImagePart`s (not fetched or decoded here)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubo.engine.request_error import RequestError, invalid_field
from bubo.engine.request_fields import json_text

__all__ = [
    "IMAGE_PART",
    "ImagePart",
    "chat_images",
    "chat_messages",
    "message_content",
    "text_content",
    "text_only",
    "without_image_sources",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ImagePart:
    """An image a request refers to, not fetched or decoded yet.

    `where` is the part's path (messages[0].content[1]), `param` the field a text-only model's refusal
    names, `kind` the part's type as sent. The source is `url` (a data:, http: or https: URL) or
    `data` (base64 text, Anthropic's base64 source; Pillow tells the format from the bytes).
    """

    where: str
    param: str
    kind: str
    url: str | None = None
    data: str | None = None

    @property
    def remote(self) -> bool:
        """Whether the bytes are elsewhere (an http or https URL)."""
        return self.url is not None and self.url.lower().startswith(("http://", "https://"))


def text_only(part: ImagePart) -> RequestError:
    """The refusal of an image part by a model without a vision tower."""
    return RequestError(
        f"{part.where}: this model takes text only (no vision tower is loaded), not {part.kind!r} parts",
        param=part.param,
        code="unsupported_content",
    )


_TEXT_PARTS = ("text", "input_text", "output_text")
_MEDIA_PARTS = ("image", "input_audio", "input_file", "video", "file")
# The neutral image part the dialects put in a message's content: {"type": "image", "image": ImagePart}.
IMAGE_PART = "image"


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: a string as is, an array of text parts (a refusal counts as
    text) joined by newlines. Media parts are refused here (tool results, assistant turns)."""
    parts = message_content(content, where, images=False)
    assert isinstance(parts, str)
    return parts


def message_content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content for the template: a string as is; an array of text parts joined into one
    string; with image parts (where `images` allows them: user messages), a list of text parts and
    neutral image parts in the order sent, for the template to put its vision tokens between."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(where, "must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise invalid_field(at, "a content part must be an object")
        kind = part.get("type")
        image = _image_part(part, at, where)
        if image is not None:
            if not images:
                raise RequestError(
                    f"{at}: images are taken in user messages only", param=where, code="unsupported_content"
                )
            parts.append({"type": IMAGE_PART, "image": image})
        elif kind in _TEXT_PARTS or kind == "refusal":
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise invalid_field(f"{at}.{key}", "must be a string")
            parts.append({"type": "text", "text": text})
        elif kind in _MEDIA_PARTS:
            raise RequestError(
                f"{at}: {kind!r} parts are not supported", param=where, code="unsupported_content"
            )
        else:
            raise invalid_field(f"{at}.type", f"unknown content part type {kind!r}")
    if any(p["type"] == IMAGE_PART for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_part(part: Mapping[str, Any], at: str, param: str) -> ImagePart | None:
    """The image of an OpenAI chat `image_url` part, a Responses `input_image` part, or a neutral image
    part a dialect made already; None for other parts."""
    kind = part.get("type")
    if kind == IMAGE_PART and isinstance(part.get("image"), ImagePart):
        return part["image"]
    if kind == "image_url":
        holder = part.get("image_url")
        url = holder.get("url") if isinstance(holder, Mapping) else holder
        where = f"{at}.image_url.url" if isinstance(holder, Mapping) else f"{at}.image_url"
    elif kind == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise RequestError(
                f"{at}.file_id: Bubo keeps no uploaded files; send the image as image_url",
                param=param,
                code="unsupported_content",
            )
        url, where = part.get("image_url"), f"{at}.image_url"
    else:
        return None
    if not isinstance(url, str) or not url:
        raise invalid_field(where, "must be a URL string (data:image/...;base64,... or https://...)")
    return ImagePart(where, param, kind, url=url)


def chat_images(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The image parts of template messages, in the order the template renders them."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == IMAGE_PART
    ]


def without_image_sources(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: each image part only {"type": "image"}."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            stripped = [{"type": IMAGE_PART} if p.get("type") == IMAGE_PART else p for p in content]
            message = {**message, "content": stripped}
        out.append(message)
    return out


def chat_messages(raw: Any, field_name: str = "messages") -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten text-part content; 400 missing_messages when absent."""
    if raw is None or raw == []:
        raise RequestError(
            f"{field_name} is required and must be a non-empty array",
            param=field_name,
            code="missing_messages",
        )
    if not isinstance(raw, list):
        raise invalid_field(field_name, "must be a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"{field_name}[{i}]"
        if not isinstance(message, Mapping):
            raise invalid_field(where, "a message must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise invalid_field(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
        out = dict(message)
        if role == "developer":
            out["role"] = "system"
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise invalid_field(f"{where}.content", "is required")
            # OpenAI's tool-call answers carry `content: null`, and clients send them back as they got
            # them. Templates that read `message.content` unguarded (Qwen3, QwQ, SmolLM2) fail on a
            # missing one; every template that takes a missing one renders "" the same (vLLM and
            # llama.cpp substitute "" too).
            out["content"] = ""
        else:
            out["content"] = message_content(content, f"{where}.content", images=role == "user")
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        messages.append(out)
    return messages


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Assistant tool calls as the templates expect them: arguments as an object when they parse."""

    if not isinstance(calls, list):
        raise invalid_field(where, "must be an array")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise invalid_field(f"{where}[{i}].function", "must be an object with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json_text(arguments, f"{where}[{i}].function.arguments") if arguments.strip() else {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
