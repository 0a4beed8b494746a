"""Splitting generated text into reasoning and answer, as it streams.

Thinking models wrap their reasoning in `<think>…</think>` (Qwen3, QwQ, Qwen3.5). The tags can arrive
split across tokens, and when the generation prompt already opened `<think>` the output starts inside
the reasoning with no opening tag at all. Text that could still be the start of a tag is held back
until the next piece decides it, so reasoning never leaks into the answer.
"""

from typing import Literal

__all__ = ["Channel", "ReasoningSplitter"]

Channel = Literal["reasoning", "content"]


class ReasoningSplitter:
    """Feeds text pieces in, gets (channel, text) pieces out; `flush()` at the end releases what was held."""

    def __init__(
        self, *, in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"
    ) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.in_reasoning = in_reasoning
        # After the reasoning closes the model usually writes blank lines before the answer; the
        # templates drop them when they re-render history, so the answer starts at its first real text.
        self._answer_started = False
        self._reasoning_started = False
        self._held = ""
        self._seen_reasoning = in_reasoning

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        out: list[tuple[Channel, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self.in_reasoning:
                at = text.find(self.close_tag)
                if at >= 0:
                    self._emit(out, "reasoning", text[:at])
                    text = text[at + len(self.close_tag) :]
                    self.in_reasoning = False
                    continue
                keep = _partial_suffix(text, self.close_tag)
                self._emit(out, "reasoning", text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            if self._seen_reasoning:
                # One reasoning block per answer: a later "<think>" is answer text.
                self._emit(out, "content", text)
                break
            at = text.find(self.open_tag)
            before = text[:at] if at >= 0 else text[: len(text) - _partial_suffix(text, self.open_tag)]
            if before.strip():
                # Answer text came first: this output has no reasoning block.
                self._seen_reasoning = True
                self._emit(out, "content", text)
                break
            if at < 0:
                # Only whitespace, perhaps ending in the start of "<think>": undecided yet.
                self._held = text
                break
            text = text[at + len(self.open_tag) :]
            self.in_reasoning = self._seen_reasoning = True
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        out: list[tuple[Channel, str]] = []
        self._emit(out, self._channel, self._held)
        self._held = ""
        return out

    @property
    def _channel(self) -> Channel:
        return "reasoning" if self.in_reasoning else "content"

    def _emit(self, out: list[tuple[Channel, str]], channel: Channel, text: str) -> None:
        if channel == "content" and not self._answer_started:
            if self._seen_reasoning:
                text = text.lstrip("\n")
            if not text:
                return
            self._answer_started = True
        if channel == "reasoning" and not self._reasoning_started:
            # "<think>\n" is how the templates open the block; the newline is layout, not reasoning.
            text = text.lstrip("\n")
            if not text:
                return
            self._reasoning_started = True
        if not text:
            return
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
