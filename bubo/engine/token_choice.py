"""Choosing each generated token: the sampler's draw under the request's constraints, shared by plain
decoding and by speculative decoding's verification (which also needs the distribution itself)."""

from collections.abc import Sequence
from typing import Protocol

import torch

from bubo.engine.sampler import Sampler, draw

__all__ = ["TokenChooser", "TokenConstraint"]


class TokenConstraint(Protocol):
    """Narrows the next token's choices: a grammar (structured output, a forced tool call) or a forced
    sequence (closing reasoning whose budget ran out). See bubo/engine/constraints.py."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token this constraint forbids now set to -inf."""
        ...

    def accept(self, token_id: int) -> None:
        """Record the token that was chosen."""
        ...


class TokenChooser:
    """The sampler and the constraints of one request: masks a logits row, draws, and records the
    chosen token in both (penalty window, grammar state)."""

    def __init__(self, sampler: Sampler, constraints: Sequence[TokenConstraint] = ()) -> None:
        self.sampler = sampler
        self.constraints = tuple(constraints)

    @property
    def greedy(self) -> bool:
        return self.sampler.params.greedy

    @property
    def generator(self) -> torch.Generator:
        return self.sampler.generator

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token a constraint forbids now set to -inf."""
        for constraint in self.constraints:
            logits = constraint.mask(logits)
        return logits

    def pick(self, logits: torch.Tensor) -> int:
        """Draw the next token from a [vocab] logits row and record it."""
        return self.pick_on_device(logits)[0]

    def pick_on_device(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """`pick`, also returning the token as the 0-d tensor on the logits' device that it was drawn as
        (fed back to the model without a copy from the host)."""
        chosen = self.sampler.sample(self.allowed(logits))
        token = int(chosen.item())  # the one host sync per token: stop checks need the id
        self.accept(token)
        return token, chosen

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The [vocab] probabilities `pick` would draw from now (one-hot when greedy)."""
        return self.sampler.probabilities(self.allowed(logits))

    def accept(self, token: int) -> None:
        """Record a token chosen some other way (an accepted draft)."""
        self.sampler.accept(token)
        for constraint in self.constraints:
            constraint.accept(token)

    def draw_draft(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft token from a drafter's logits row, and the distribution it was drawn from (None when
        greedy: the draft is the argmax, and verification compares it with the target's argmax). The
        constraints are not applied: a draft they forbid is simply rejected."""
        if self.greedy:
            return int(self.sampler.process(logits).argmax().item()), None
        q = self.sampler.probabilities(logits)
        return int(draw(q, self.generator).item()), q
