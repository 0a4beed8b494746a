"""Drafts without a draft model: the tokens that followed the last earlier occurrence of the context's
newest n-gram (prompt lookup decoding; llama-server's `--spec-type ngram-simple`, vLLM's `ngram`).

Text that repeats what came before (code being edited, a document quoted or summarised, JSON that echoes
its input, a template filled again) is predicted well by its own history: when the last `size_n` tokens
appeared before, the tokens that came after them then are likely to come again. Nothing is computed to
find them: a dictionary maps every n-gram seen to where it last ended, grown by the new positions each
round. A round with no match drafts nothing, and SpeculativeDecoder runs the plain decode step for it;
a draft is checked in one pass over its tokens (the compiled step's several-token pass on the CPU), so
text that doesn't repeat itself pays nothing, and text that does takes several tokens a pass.

The draft is deterministic (q one-hot), so under sampling a drafted token d is kept with probability
p(d) and the output keeps plain decoding's distribution (bubo/engine/speculative.py).
"""

from collections.abc import Sequence

import torch

from bubo.engine.speculative import Draft, DrawDraft

__all__ = ["DEFAULT_NGRAM_DRAFT", "DEFAULT_NGRAM_SIZE", "NgramDrafter"]

# Tokens drafted per round, and the n-gram that must match, by default (`--spec-draft`,
# `--spec-ngram-simple-size-n`): see benchmarks/bench_prompt_lookup.py's figures in the README.
DEFAULT_NGRAM_DRAFT = 2
DEFAULT_NGRAM_SIZE = 3


class NgramDrafter:
    """Proposes up to `max_draft` tokens: those that followed the most recent earlier occurrence of the
    context's last `size_n` tokens, or none when they haven't occurred before."""

    needs_hidden = False

    def __init__(self, max_draft: int, size_n: int = DEFAULT_NGRAM_SIZE) -> None:
        if max_draft < 1 or size_n < 1:
            raise ValueError(
                f"an n-gram drafter needs max_draft >= 1 and size_n >= 1, got {max_draft}, {size_n}"
            )
        self.max_draft = max_draft
        self.size_n = size_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # context positions whose n-gram ending there is in _ends

    def start(self, max_len: int) -> None:
        self._ends.clear()
        self._indexed = 0

    def propose(
        self, context: Sequence[int], hidden: torch.Tensor | None, n: int, draw_draft: DrawDraft
    ) -> Draft:
        size, length = self.size_n, len(context)
        if n < 1 or length <= size:
            return Draft([])
        # Index the n-grams that end before the newest position; the newest one is what is looked up,
        # and must have occurred earlier.
        for end in range(max(self._indexed, size), length):
            self._ends[tuple(context[end - size : end])] = end
        self._indexed = length
        end = self._ends.get(tuple(context[length - size :]))
        if end is None:
            return Draft([])
        return Draft(list(context[end : min(end + n, length)]))
