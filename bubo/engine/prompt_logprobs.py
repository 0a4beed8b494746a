"""The log probability of every prompt token given the tokens before it: what evaluation harnesses
score a multiple-choice answer by (OpenAI's legacy `echo` with `logprobs` on /v1/completions).

The prompt runs through a cache of its own, so the slot's cache and what it has computed stay as they
were; the logits come a piece at a time, so a long prompt never holds [tokens, vocab] floats at once.
"""

from collections.abc import Sequence
from typing import Any

import torch

from bubo.engine.generate import TokenLogprob

__all__ = ["prompt_logprobs"]

# Positions whose logits are computed together: 256 x a 150k vocabulary is 150 MB of float32.
_PIECE = 256


def prompt_logprobs(model: Any, prompt_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each prompt token after the first, its log probability given the ones before it (the
    log-softmax of the raw logits) and the `top` most likely tokens in its place."""
    cache = model.new_cache(max_len=len(prompt_ids))
    out: list[TokenLogprob] = []
    with torch.inference_mode():
        for start in range(0, len(prompt_ids) - 1, _PIECE):
            end = min(start + _PIECE, len(prompt_ids) - 1)
            tokens = torch.tensor([list(prompt_ids[start:end])], device=model.device)
            logprobs = model(tokens, cache).float().log_softmax(-1)[0]
            following = torch.tensor(prompt_ids[start + 1 : end + 1], device=logprobs.device)
            chosen = logprobs.gather(-1, following[:, None])[:, 0].tolist()
            if top > 0:
                values, ids = logprobs.topk(top, dim=-1)
                alternatives = [
                    tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            else:
                alternatives = [()] * len(chosen)
            out += [
                TokenLogprob(token, value, alts)
                for token, value, alts in zip(
                    prompt_ids[start + 1 : end + 1], chosen, alternatives, strict=True
                )
            ]
    return out
