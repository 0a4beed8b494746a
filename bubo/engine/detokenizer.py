"""Token ids → text while streaming, and stop strings that may straddle token boundaries."""

import codecs
from collections.abc import Callable, Iterable, Sequence


class IncrementalDetokenizer:
    """Turns a stream of token ids into text that is always valid UTF-8.

    Byte-level vocabularies split a character's bytes across tokens (an emoji can take four tokens),
    so bytes are decoded with an incremental UTF-8 decoder: an incomplete sequence waits for the next
    token, and bytes that can never become a character come out as U+FFFD as soon as that is certain.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Decode more tokens; returns the text they complete (possibly empty)."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self._decoder.decode(b"".join(self._token_bytes(t) for t in ids))

    def flush(self) -> str:
        """End of stream: a sequence still incomplete can no longer finish, so it becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text and holds back what could still become one.

    `feed` returns the text that is safe to emit. Text that is a prefix of some stop string waits
    until the next piece decides it. On a match, `feed` returns only the text before the earliest
    stop string and sets `matched`; the stop string itself is never emitted (as in the OpenAI API).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.matched: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        buffer = self._held + text
        # Everything before the held text was already cleared, so a match can only start inside it.
        found = [(i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if found:
            at, self.matched = min(found, key=lambda hit: hit[0])
            self._held = ""
            return buffer[:at]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """End of stream: a held prefix that never became a stop string is plain text after all."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
