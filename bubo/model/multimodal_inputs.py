"""What a decoder call needs besides token ids when some of its tokens stand for an image."""

from dataclasses import dataclass

import torch

__all__ = ["MultimodalInputs"]


@dataclass(frozen=True)
class MultimodalInputs:
    rows: torch.Tensor  # [n] int64: indices into this call's T tokens that take image embeddings
    embeds: torch.Tensor  # [n, hidden]: replace the token embeddings at `rows` (masked scatter)
    positions: torch.Tensor  # [3, T] int64: the mrope positions of this call's T tokens

    def check(self, length: int, hidden: int) -> None:
        """Raise ValueError unless these inputs fit a call of `length` tokens into a model of width `hidden`."""
        n = self.rows.shape[0] if self.rows.dim() == 1 else -1
        if n < 0 or self.rows.dtype != torch.int64:
            raise ValueError(
                f"rows must be a 1-D int64 tensor, got {self.rows.dtype} {tuple(self.rows.shape)}"
            )
        if tuple(self.embeds.shape) != (n, hidden):
            raise ValueError(
                f"embeds of shape {tuple(self.embeds.shape)}: expected [{n}, {hidden}] for {n} rows"
            )
        if tuple(self.positions.shape) != (3, length) or self.positions.dtype != torch.int64:
            raise ValueError(
                f"positions must be int64 [3, {length}], got {self.positions.dtype} {tuple(self.positions.shape)}"
            )
        if n and (int(self.rows.min()) < 0 or int(self.rows.max()) >= length):
            raise ValueError(f"rows must index the call's {length} tokens")
        if n and self.rows.unique().shape[0] != n:
            raise ValueError("rows must not repeat")
