"""From generated text to the neutral output events.

The engine produces text; what a client sees is reasoning, answer text and tool calls. Reasoning is
split off first (`ReasoningSplitter`), then the answer's tool-call markup is parsed out of it
(`ToolCallParser`, when the request offered tools). Both hold back text that could be the start of a
tag, so nothing is sent on one channel and then found to belong to another.
"""

from bubo.engine.generate import TextDelta, TokenLogprob
from bubo.engine.request import OutputDelta, OutputEvent
from bubo.templates.reasoning import Channel, ReasoningSplitter
from bubo.templates.tool_calls import TextPiece, ToolCall, ToolCallEnd, ToolCallParser

__all__ = ["OutputStream"]


class OutputStream:
    """One generation's output: `feed` each TextDelta, then `flush`; the texts accumulate."""

    def __init__(
        self, *, reasoning: bool, in_reasoning: bool, tool_parser: ToolCallParser | None, slot_id: int = 0
    ) -> None:
        self.slot_id = slot_id  # which slot generates (llama-server's id_slot in every chunk)
        self._splitter = ReasoningSplitter(in_reasoning=in_reasoning) if reasoning else None
        self._tools = tool_parser
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._content_length = 0
        # How much answer text came before each completed call: where the calls sit in the answer.
        self.tool_call_offsets: list[int] = []
        self.content_logprobs: list[TokenLogprob] = []
        self.reasoning_tokens = 0
        # Tokens and log probabilities waiting for a piece of text to ride on (text can be held back).
        self._logprobs: tuple[TokenLogprob, ...] = ()
        self._token_ids: tuple[int, ...] = ()

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def content_text(self) -> str:
        return "".join(self._content)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._tools.calls) if self._tools is not None else ()

    def feed(self, delta: TextDelta) -> list[OutputEvent]:
        splitter = self._splitter
        pieces: list[tuple[Channel, str]] = (
            splitter.feed(delta.text) if splitter else [("content", delta.text)]
        )
        if any(channel == "reasoning" for channel, _ in pieces) or (splitter and splitter.in_reasoning):
            self.reasoning_tokens += len(delta.token_ids)
        self._logprobs += delta.logprobs
        self._token_ids += tuple(delta.token_ids)
        return self._route(pieces, final=False)

    def flush(self) -> list[OutputEvent]:
        pieces = self._splitter.flush() if self._splitter else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[tuple[Channel, str]], final: bool) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for channel, text in pieces:
            if channel == "reasoning":
                self._reasoning.append(text)
                events.append(self._delta("reasoning", text))
            elif self._tools is None:
                events.append(self._text(text))
            else:
                events += self._parsed(self._tools.feed(text))
        if final and self._tools is not None:
            events += self._parsed(self._tools.flush())
        return events

    def _parsed(self, tool_events: list) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for event in tool_events:
            if isinstance(event, TextPiece):
                events.append(self._text(event.text))
                continue
            if isinstance(event, ToolCallEnd):
                self.tool_call_offsets.append(self._content_length)
            events.append(event)
        return events

    def _text(self, text: str) -> OutputDelta:
        self._content.append(text)
        self._content_length += len(text)
        self.content_logprobs += self._logprobs
        return self._delta("content", text)

    def _delta(self, channel: Channel, text: str) -> OutputDelta:
        delta = OutputDelta(channel, text, self._logprobs, self.slot_id, self._token_ids)
        self._logprobs, self._token_ids = (), ()
        return delta
