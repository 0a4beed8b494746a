"""Speculative decoding: a drafter proposes the next few tokens, the model checks them all in one
forward pass, and the agreeing prefix is kept, plus one token of the model's own.

Two drafters: the model's MTP block (bubo/model/mtp.py, bubo/model/hyper_connected_mtp.py; here):
from the main model's final hidden state at position t (qwen4exp: its residual streams) and token t+1
it predicts token t+2, and chained on its own hidden states it proposes N tokens; and the context's
own history (bubo/engine/ngram_drafter.py: what followed the last earlier occurrence of the newest
n-gram), for any model. One round, with the cache holding L positions
and `last` the newest token, not yet run:

    draft d_1..d_N;  one forward over [last, d_1..d_N] at positions L..L+N  ->  target rows p_0..p_N
    for i = 1..N: check d_i against p_{i-1}; on the first rejection, the replacement token ends the round
    all N accepted: one more token from p_N

so a round yields between 1 and N+1 tokens for one forward of the main model.

Acceptance. Greedy: d_i is kept when it is the token the sampler picks from p_{i-1}, so the output is
the one plain decoding gives. Sampling: speculative sampling (Leviathan, Kalman & Matias, "Fast
Inference from Transformers via Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large
Language Model Decoding with Speculative Sampling", 2023): d ~ q is kept with probability
min(1, p(d)/q(d)), otherwise the token is drawn from norm(max(0, p - q)); the kept-or-redrawn token is
then distributed exactly as p, whatever q is. p is the request's full sampling distribution (penalties,
logit bias, top-k/p, min-p, temperature and grammar constraints applied, in order along the accepted
prefix), so every feature of plain decoding carries over.

Rollback. Attention keys and values past the kept length are simply overwritten later (truncate). A
Gated DeltaNet state can't be rewound, so the verify pass asks each DeltaNet layer for copies of its
state after every draft position (KVCache.snapshot_at; the layer computes its projections once) and
the one at the kept length is restored. qwen4exp's QSA indexer and PLE states have no such copies: the
states before the pass are kept, and a partial acceptance restores them and runs the kept tokens again
(one more forward, only when a draft is rejected). The MTP block's own cache drops the rows made from its
chained guesses, which are redone from the main model's real hidden states next round.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from bubo.engine.runner import runner_for
from bubo.engine.sampler import draw
from bubo.engine.token_choice import TokenChooser
from bubo.model.state import CacheSnapshot, KVCache

__all__ = [
    "DEFAULT_SPEC_DRAFT",
    "Draft",
    "Drafter",
    "MTPDrafter",
    "SpeculativeDecoder",
    "accept_or_resample",
    "mtp_drafter",
]

# Tokens drafted per round by default for a model with an MTP block (`--spec-draft`). Measured with
# benchmarks/bench_speculative.py on the CPU: with drafts that all miss, a round cost ~1.5 plain steps
# with one draft and ~2.4 with two, so one draft pays off from ~55% acceptance and loses least when
# drafts miss; two only win when nearly every draft is kept.
DEFAULT_SPEC_DRAFT = 1


# A drafter's way to turn one of its logits rows into a token: the token and the distribution it was
# drawn from (None: chosen deterministically).
DrawDraft = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, per token, the [vocab] distribution it was drawn from ([n, vocab]); None
    when the tokens were chosen deterministically (acceptance then treats q as one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes tokens for SpeculativeDecoder."""

    max_draft: int  # N: tokens proposed per round at most
    needs_hidden: bool  # whether `propose` reads the model's hidden states (else it gets None)

    def start(self, max_len: int) -> None:
        """A new sequence of at most `max_len` positions begins."""
        ...

    def propose(
        self, context: Sequence[int], hidden: torch.Tensor | None, n: int, draw_draft: DrawDraft
    ) -> Draft:
        """Up to `n` tokens to follow `context` (prompt and generated tokens so far). `hidden` [1, k, ..]
        holds what the MTP block continues from (Decoder.hidden_and_mtp_input: the final hidden states,
        or qwen4exp's residual streams) at the k positions run since the last call; row j is the state
        that `context[-k + j]` was chosen from (None for a drafter that doesn't need them)."""
        ...


class DraftModel(Protocol):
    """What speculation needs from bubo.model.decoder.Decoder."""

    device: torch.device
    output: nn.Module

    def hidden(
        self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False, multimodal: Any = None
    ) -> torch.Tensor: ...

    def hidden_and_mtp_input(
        self, tokens: torch.Tensor, cache: KVCache, multimodal: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_hidden(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, mtp_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draft_head(self, head_input: torch.Tensor) -> torch.Tensor: ...

    def new_mtp_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache: ...


class MTPDrafter:
    """Drafts with the model's MTP block, chaining it on its own hidden states for more than one token.

    Its cache holds one row per position of the current sequence that has been run by the main model
    (from `start` on: a cached prompt prefix is not replayed, and attention under RoPE only sees
    relative positions), plus the rows of the last round's chained guesses, dropped on the next call
    (cut off, or for qwen4exp's block, whose QSA indexer state can't be cut, restored from a snapshot
    taken after the settled rows).
    """

    needs_hidden = True

    def __init__(self, model: DraftModel, max_draft: int) -> None:
        if max_draft < 1:
            raise ValueError(f"an MTP drafter proposes at least 1 token per round, got {max_draft}")
        self.model = model
        self.max_draft = max_draft
        self._cache: KVCache | None = None
        self._settled: CacheSnapshot | int = 0  # the rows made from the main model's own hidden states

    def start(self, max_len: int) -> None:
        if self._cache is None or self._cache.max_len < max_len:
            self._cache = self.model.new_mtp_cache(max_len=max_len)
        self._cache.reset()
        self._settled = 0

    def propose(
        self, context: Sequence[int], hidden: torch.Tensor | None, n: int, draw_draft: DrawDraft
    ) -> Draft:
        cache = self._cache
        if cache is None or hidden is None:
            raise RuntimeError("MTPDrafter.propose before start, or without hidden states")
        if isinstance(self._settled, CacheSnapshot):
            cache.restore(self._settled)
        else:
            cache.truncate(self._settled)
        device = self.model.device
        k = hidden.shape[1]
        next_tokens = torch.tensor([list(context[-k:])], dtype=torch.long, device=device)
        x, chained = self.model.draft_hidden(hidden, next_tokens, cache)
        x, chained = x[:, -1:], chained[:, -1:]
        self._settled = cache.length if cache.can_rewind else cache.snapshot()
        tokens: list[int] = []
        probs: list[torch.Tensor] = []  # stays empty when drafting greedily
        for i in range(n):
            token, q = draw_draft(self.model.draft_head(x)[0, -1])
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < n:
                x, chained = self.model.draft_hidden(chained, torch.tensor([[token]], device=device), cache)
        return Draft(tokens, torch.stack(probs) if probs else None)


def mtp_drafter(model: DraftModel, spec_draft: int | None) -> MTPDrafter | None:
    """The drafter `--spec-draft` asks for: `spec_draft` tokens per round (0: none; None: DEFAULT_SPEC_DRAFT
    when the model has an MTP block, else none). ValueError for a count on a model without a block."""
    # Test doubles standing in for the Decoder have no MTP attribute at all.
    has_mtp = getattr(model, "mtp", None) is not None
    if spec_draft is None:
        spec_draft = DEFAULT_SPEC_DRAFT if has_mtp else 0
    if spec_draft < 0:
        raise ValueError(f"--spec-draft must be >= 0 (0 = off), got {spec_draft}")
    if not spec_draft:
        return None
    if not has_mtp:
        raise ValueError(
            f"--spec-draft {spec_draft}: this model has no MTP block to draft with "
            "(give its checkpoint's with --mtp-weights PATH, or use --spec-draft 0)"
        )
    return MTPDrafter(model, spec_draft)


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator
) -> tuple[int, bool]:
    """Speculative sampling's acceptance step (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023):
    a draft `token` drawn from q is kept with probability min(1, p(token) / q(token)); otherwise a token
    is drawn from max(0, p - q), renormalised. Returns the token and whether the draft was kept; the
    token is distributed as p."""
    u = torch.rand((), generator=generator, device=p.device)
    if bool(u * q[token] < p[token]):
        return token, True
    residual = (p - q).clamp_min(0)
    # An all-zero residual means p == q, where the draft is always kept: reached only by rounding.
    if not bool(residual.sum() > 0):
        residual = p
    return int(draw(residual, generator).item()), False


class SpeculativeDecoder:
    """generate()'s token source with a drafter: `prefill` the prompt, then iterate `tokens`.

    Counts the drafted (`proposed`) and kept (`accepted`) tokens, and the verify passes that checked a
    draft (`verify_steps`). Closing the iterator early leaves
    the cache holding exactly the tokens yielded so far, all but the last, as plain decoding does.
    """

    def __init__(self, model: DraftModel, cache: KVCache, chooser: TokenChooser, drafter: Drafter) -> None:
        self.model, self.cache, self.chooser, self.drafter = model, cache, chooser, drafter
        self.proposed = 0
        self.accepted = 0
        self.verify_steps = 0
        self._hidden: torch.Tensor | None = None
        self._verified: list[int] = []  # the last verify pass's tokens, where a rollback reruns them
        drafter.start(cache.max_len)

    def prefill(self, tokens: torch.Tensor, multimodal: Any = None) -> torch.Tensor:
        """Run the uncached prompt tokens [1, T] (with their image inputs, if any); the last position's
        logits [vocab]."""
        images = {} if multimodal is None else {"multimodal": multimodal}
        hidden, self._hidden = self.model.hidden_and_mtp_input(tokens, self.cache, **images)
        return self.model.output(hidden[:, -1:])[0, -1].float()

    def tokens(
        self, logits: torch.Tensor, context: Sequence[int], limit: int | None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Tokens and the logits row each was chosen from, starting from the prompt's last `logits`;
        `context` is the prompt, `limit` the most tokens the caller will take (None: no limit). A drafter
        that reads hidden states needs the prompt run by `prefill`; any other takes the cache as it is."""
        if self._hidden is None and self.drafter.needs_hidden:
            raise RuntimeError("SpeculativeDecoder.tokens before prefill")
        context = list(context)
        hidden, cache = self._hidden, self.cache
        # A drafter without hidden states has its rounds checked by the compiled step where it covers the
        # model and cache (one pass over the round's tokens; the plain decode step when nothing was drafted).
        step = runner_for(self.model).verify_step(cache, self.drafter.needs_hidden)
        token = self.chooser.pick(logits)
        context.append(token)
        emitted = 1
        yield token, logits
        while True:
            start = cache.length
            # Room for the verify pass's n+1 positions, and no drafts past the caller's limit.
            n = min(self.drafter.max_draft, cache.max_len - start - 1)
            if limit is not None:
                n = min(n, limit - emitted - 1)
            # KV blocks shared with other slots may be short: draft only what fits.
            while n > 0 and not cache.reserve(n + 1):
                n -= 1
            draft = self.drafter.propose(context, hidden, max(n, 0), self.chooser.draw_draft)
            self.proposed += len(draft.tokens)
            self.verify_steps += bool(draft.tokens)
            if step is None:
                verified, rows, snapshots = self._verify(start, [context[-1], *draft.tokens])
            else:
                # No hidden states come back from the compiled step, and none are wanted.
                checked = torch.tensor([context[-1], *draft.tokens], device=self.model.device)
                verified, rows, snapshots = None, step(checked, cache), {}
            chosen = self._accept(draft, rows)
            kept = 0
            try:
                for token, row in chosen:
                    kept += 1
                    context.append(token)
                    yield token, row
            finally:
                self._roll_back(start + kept, snapshots)
            hidden = None if verified is None else verified[:, : len(chosen)]
            emitted += len(chosen)

    def _verify(
        self, start: int, tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, CacheSnapshot]]:
        """One forward over `tokens` at positions start..; what the MTP block continues from at them
        ([1, n+1, H], or qwen4exp's residual streams), logits rows [n+1, vocab], and for a recurrent
        cache the states after each prefix, by length."""
        cache = self.cache
        batch = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        if cache.can_rewind:
            hidden, mtp_input = self.model.hidden_and_mtp_input(batch, cache)
            return mtp_input, self.model.output(hidden)[0].float(), {}
        if not cache.snapshots_in_forward:
            # qwen4exp's QSA indexer tails and PLE history have no copies inside a pass: keep the states
            # as they are before it; a partial acceptance restores them and reruns the kept tokens.
            self._verified = tokens
            before = {start: cache.snapshot()}
            hidden, mtp_input = self.model.hidden_and_mtp_input(batch, cache)
            return mtp_input, self.model.output(hidden)[0].float(), before
        positions = tuple(range(start + 1, start + len(tokens)))
        # The prompt cache may have asked for copies at prompt positions; those stay where they are.
        wanted = cache.snapshot_at
        cache.snapshot_at = (*wanted, *positions)
        try:
            hidden, mtp_input = self.model.hidden_and_mtp_input(batch, cache)
        finally:
            cache.snapshot_at = wanted
        snapshots = {}
        for position in positions:
            taken = cache.taken.pop(position)
            recurrent = tuple(taken[i] for i in range(len(cache.recurrent)))
            snapshots[position] = CacheSnapshot(position, recurrent, (), None)
        return mtp_input, self.model.output(hidden)[0].float(), snapshots

    def _accept(self, draft: Draft, rows: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The tokens this round yields, each with the logits row it was chosen from."""
        chooser = self.chooser
        chosen = []
        for i, proposed in enumerate(draft.tokens):
            if chooser.greedy:
                token = chooser.pick(rows[i])
                kept = token == proposed
            else:
                p = chooser.distribution(rows[i])
                if draft.probs is not None:
                    q = draft.probs[i]
                else:
                    q = torch.zeros_like(p).scatter_(0, torch.tensor([proposed], device=p.device), 1.0)
                token, kept = accept_or_resample(p, q, proposed, chooser.generator)
                chooser.accept(token)
            chosen.append((token, rows[i]))
            if not kept:
                return chosen
            self.accepted += 1
        last = len(draft.tokens)
        chosen.append((chooser.pick(rows[last]), rows[last]))
        return chosen

    def _roll_back(self, length: int, snapshots: dict[int, CacheSnapshot]) -> None:
        """Keep the first `length` positions of the cache."""
        cache = self.cache
        if length == cache.length:
            return
        if cache.can_rewind:
            cache.truncate(length)
        elif length in snapshots:
            cache.restore(snapshots[length])
        else:
            start = min(snapshots)
            cache.restore(snapshots[start])
            kept = torch.tensor(
                [self._verified[: length - start]], dtype=torch.long, device=self.model.device
            )
            self.model.hidden(kept, cache)
