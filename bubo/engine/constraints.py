"""Token constraints applied during generation (see `TokenConstraint` in token_choice.py).

Two kinds: a `GrammarConstraint` keeps the answer inside a grammar (JSON schema output, a forced tool
call), and a `ReasoningBudget` closes a reasoning block whose token budget ran out by forcing the
closing tag, so the answer can start. Both follow the reasoning block with a `ReasoningTracker`:
the grammar applies to the answer only, so a thinking model still thinks freely first.
"""

import weakref
from typing import Any, Literal, Protocol

import torch

from bubo.engine.grammar import GrammarMatcher

__all__ = ["GrammarConstraint", "ReasoningBudget", "ReasoningTracker"]

Phase = Literal["undecided", "reasoning", "answer"]


class _Tokens(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]: ...


class ReasoningTracker:
    """Where generated tokens stand relative to a `<think>…</think>` block.

    "undecided": the model may still open a block (only whitespace and a prefix of the opening tag so
    far); "reasoning": inside the block; "answer": after it, or there is none.
    """

    def __init__(
        self,
        tokenizer: _Tokens,
        *,
        reasoning: bool,
        in_reasoning: bool,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        self.tokenizer = tokenizer
        self.open_tag = open_tag.encode()
        self.close_tag = close_tag.encode()
        self.phase: Phase = "reasoning" if in_reasoning else "undecided" if reasoning else "answer"
        self._text = b""

    def accept(self, token_id: int) -> None:
        if self.phase == "answer":
            return
        self._text += self.tokenizer.token_bytes(token_id)
        if self.phase == "undecided":
            head = self._text.lstrip()
            if head.startswith(self.open_tag):
                self.phase = "reasoning"
                self._text = head[len(self.open_tag) :]
            elif not self.open_tag.startswith(head):
                self.phase = "answer"
        if self.phase == "reasoning" and self.close_tag in self._text:
            self.phase = "answer"

    def opening_continues(self, token_id: int) -> bool:
        """Whether `token_id` keeps an undecided output on its way to the opening tag."""
        head = (self._text + self.tokenizer.token_bytes(token_id)).lstrip()
        return bool(head) and (head.startswith(self.open_tag) or self.open_tag.startswith(head))


# Per tokenizer and tag, the tokens that can be part of the tag: a scan of the whole vocabulary
# (~0.2 s for 150k tokens), done once rather than per request.
_TAG_PIECES: "weakref.WeakKeyDictionary[Any, dict[tuple[bytes, int], list[int]]]" = (
    weakref.WeakKeyDictionary()
)


def _tag_pieces(tokenizer: _Tokens, tag: bytes, size: int) -> list[int]:
    """Tokens that could be part of an opening tag: leading whitespace, a piece from the tag's start,
    its middle, or its end (possibly running on past it)."""
    cache = _TAG_PIECES.setdefault(tokenizer, {})
    if (tag, size) not in cache:

        def piece_of_tag(b: bytes) -> bool:
            head = b.lstrip()
            return (
                head == b""
                or tag.startswith(head)
                or b in tag
                or any(b.startswith(tag[k:]) for k in range(len(tag)))
            )

        cache[tag, size] = [t for t in range(size) if piece_of_tag(tokenizer.token_bytes(t))]
    return cache[tag, size]


class GrammarConstraint:
    """Masks the answer to a grammar; reasoning before it is left free.

    While the output is undecided the mask allows the grammar's tokens and the tokens that continue an
    opening `<think>`. A token both could take is consumed by the grammar tentatively and rolled back
    if the output turns out to be a reasoning block; a token only the tag could take commits the
    output to the tag, so the grammar never misses a character of the answer.
    """

    def __init__(self, matcher: GrammarMatcher, tracker: ReasoningTracker) -> None:
        self.matcher = matcher
        self.tracker = tracker
        self._tentative = 0
        self._committed_to_tag = False
        self._candidates: list[int] | None = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        phase = self.tracker.phase
        if phase == "reasoning":
            return logits
        vocab = logits.shape[-1]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        if not self._committed_to_tag:
            grammar = self.matcher.allowed()[:vocab]
            allowed[: grammar.numel()] = grammar
        if phase == "undecided":
            for token in self._opening_candidates(vocab):
                if self.tracker.opening_continues(token):
                    allowed[token] = True
        return logits.masked_fill(~allowed.to(logits.device), -torch.inf)

    def _opening_candidates(self, vocab: int) -> list[int]:
        if self._candidates is None:
            size = min(vocab, self.matcher.vocab_size)
            self._candidates = _tag_pieces(self.tracker.tokenizer, self.tracker.open_tag, size)
        return self._candidates

    def accept(self, token_id: int) -> None:
        before = self.tracker.phase
        if before == "reasoning":
            self.tracker.accept(token_id)
            return
        grammar_token = not self._committed_to_tag and self.matcher.accepts(token_id)
        self.tracker.accept(token_id)
        after = self.tracker.phase
        if before == "undecided" and after == "reasoning":
            # It was the opening of a reasoning block, not the answer: forget what the grammar saw.
            if self._tentative:
                self.matcher.rollback(self._tentative)
            self._tentative, self._committed_to_tag = 0, False
            return
        if grammar_token:
            self.matcher.consume(token_id)
            self._tentative = self._tentative + 1 if after == "undecided" else 0
        elif after == "undecided":
            self._committed_to_tag = True


class ReasoningBudget:
    """Ends reasoning after `budget` tokens by forcing the closing tag (and a blank line), as
    `reasoning_effort` levels promise; the model then writes its answer."""

    def __init__(self, tokenizer: _Tokens, budget: int, tracker: ReasoningTracker) -> None:
        self.budget = budget
        self.tracker = tracker
        self.spent = 0
        self._closing = tokenizer.encode("\n" + tracker.close_tag.decode() + "\n\n", add_bos=False)
        self._forced: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._forced:
            return logits
        forced = torch.full_like(logits, -torch.inf)
        forced[self._forced[0]] = 0.0
        return forced

    def accept(self, token_id: int) -> None:
        if self._forced:
            self._forced.pop(0)
            self.tracker.accept(token_id)
            return
        was_reasoning = self.tracker.phase == "reasoning"
        self.tracker.accept(token_id)
        if was_reasoning and self.tracker.phase == "reasoning":
            self.spent += 1
            if self.spent >= self.budget and not self._forced:
                self._forced = list(self._closing)
