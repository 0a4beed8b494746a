"""What the ingress hands a replica for one HTTP request, what the replica answers first, and the text
a request is routed by."""

import json
from dataclasses import dataclass

__all__ = ["ROUTING_TEXT_LIMIT", "Forwarded", "Head", "routing_text"]

# The body fields a chat template renders, in the order they come in the prompt: tools and the system
# text first, then the turns (OpenAI chat and completions, Anthropic, Responses, llama-server).
PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")
# Characters of routing text kept: enough to tell conversations apart by their start, and a bound on
# the router's work for a request carrying megabytes of inline images.
ROUTING_TEXT_LIMIT = 32768


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the ingress received it, for a replica's own server to answer."""

    method: str
    path_qs: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    # The request's prompt as text (routing_text): the router sends a request where its prefix went.
    prompt: str = ""
    # A replica's id: the request goes to that replica only (the ingress's /metrics asks each one).
    replica: str | None = None


@dataclass(frozen=True)
class Head:
    """A replica's answer before its body: the status, the headers, and which replica answered."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str

    @property
    def is_stream(self) -> bool:
        return any(
            name.lower() == "content-type" and value.startswith("text/event-stream")
            for name, value in self.headers
        )


def routing_text(body: bytes) -> str:
    """The prompt a JSON body asks for, as canonical JSON of its prompt fields: a conversation's next
    turn starts with the text of its previous one, as the rendered prompt does. "" when the body has no
    prompt (a GET, a body that is not a JSON object)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    text = "".join(
        json.dumps(data[name], sort_keys=True, ensure_ascii=False) for name in PROMPT_FIELDS if name in data
    )
    return text[:ROUTING_TEXT_LIMIT]
