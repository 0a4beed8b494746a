"""Per-token probes of a finished generation (the server's `bubo_probe`, with --debug-hooks): for each
generated token, what chosen layers computed at the pass that chose it, summarised small enough to send
with the answer: the logit lens's top tokens, the experts the router picked and their weights, the
residual's norm.

The generation itself runs untouched (the fast path, batched with other slots'); afterwards its prompt
and tokens are run again through a fresh cache of their own under a trace (bubo/model/trace.py), a
piece at a time. Token k's entry is the pass at the position before it (the prompt's last position for
the first token), whose output chose it. With several slots each piece runs on the batcher's compute
thread between the other slots' passes (`run`), so the trace's hooks only ever see the probe's own.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from bubo.engine.generate import Tokenizer
from bubo.model.decoder import Decoder
from bubo.model.state import KVCache
from bubo.model.trace import Trace

__all__ = ["ProbeSpec", "TokenProbe", "check_probe", "probe_tokens"]

# Positions run through the traced model at once: the lens's logits of a piece are [_PIECE, vocab]
# float32 per layer (40 MB with a 152k vocabulary).
_PIECE = 64


@dataclass(frozen=True)
class ProbeSpec:
    """Which layers to read, per kind of capture, and how many lens tokens per layer."""

    router: tuple[int, ...] = ()
    logit_lens: tuple[int, ...] = ()
    residual_norm: tuple[int, ...] = ()
    top_k: int = 5

    def values_per_token(self, experts_per_token: int) -> int:
        """How many numbers each token's entry holds (what the server's size cap counts)."""
        return (
            len(self.logit_lens) * self.top_k + len(self.router) * experts_per_token + len(self.residual_norm)
        )


@dataclass(frozen=True)
class TokenProbe:
    """One generated token's captures: `position` is the pass that chose it. `logit_lens` maps a layer to
    its top (token id, text, log probability); `router` a layer to the (expert, weight) pairs the layer
    used; `residual_norm` a layer to the residual's L2 norm (qwen4exp: over all its streams)."""

    position: int
    token_id: int
    text: str
    logit_lens: dict[int, tuple[tuple[int, str, float], ...]] = field(default_factory=dict)
    router: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    residual_norm: dict[int, float] = field(default_factory=dict)


def check_probe(model: Any, spec: ProbeSpec) -> None:
    """ValueError naming the kind of capture when a layer is out of range or lacks the site (a router
    on a layer without experts), or when `model` is not a Decoder (whose modules a trace hooks)."""
    if not isinstance(model, Decoder):
        raise ValueError(f"the model ({type(model).__name__}) can't be probed")
    for kind, site in (("router", "router"), ("logit_lens", "residual"), ("residual_norm", "residual")):
        layers = getattr(spec, kind)
        if layers:
            try:
                Trace(model, [site], layers)
            except ValueError as error:
                raise ValueError(f"{kind}: {error}") from None


def _now(work: Callable[[], Any]) -> Any:
    return work()


def probe_tokens(
    model: Any,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    spec: ProbeSpec,
    run: Callable[[Callable[[], Any]], Any] | None = None,
) -> list[TokenProbe]:
    """Each of `token_ids` (generated after `prompt_ids`) with its captures. `run` runs one piece of work
    on the model (the batcher's compute thread, with several slots; None: here)."""
    if not isinstance(model, Decoder):
        raise TypeError(f"only a Decoder can be probed, not {type(model).__name__}")
    if not token_ids:
        return []
    run = run or _now
    sequence = [*prompt_ids, *token_ids[:-1]]
    first = len(prompt_ids) - 1
    cache = model.new_cache(max_len=len(sequence))
    for start in range(0, first, _PIECE):
        run(partial(_advance, model, sequence[start : min(start + _PIECE, first)], cache))
    probes: list[TokenProbe] = []
    for start in range(first, len(sequence), _PIECE):
        end = min(start + _PIECE, len(sequence))
        chosen = token_ids[start - first : end - first]
        piece = partial(_probe_piece, model, tokenizer, sequence[start:end], chosen, start, cache, spec)
        probes += run(piece)
    return probes


def _advance(model: Decoder, ids: Sequence[int], cache: KVCache) -> None:
    with torch.inference_mode():
        model(torch.tensor([list(ids)], device=model.device), cache, last_only=True)


def _probe_piece(
    model: Decoder,
    tokenizer: Tokenizer,
    ids: Sequence[int],
    chosen: Sequence[int],
    start: int,
    cache: KVCache,
    spec: ProbeSpec,
) -> list[TokenProbe]:
    """The pass over `ids` (positions from `start`) under a trace, summarised per position."""
    residual_layers = sorted({*spec.logit_lens, *spec.residual_norm})
    layers = {"residual": residual_layers, "router": list(spec.router)}
    sites = [site for site, wanted in layers.items() if wanted]
    with torch.inference_mode():
        with Trace(model, sites, {site: layers[site] for site in sites}) as trace:
            # Every position's logits (not last_only): the last layer's captures cover the whole piece.
            model(torch.tensor([list(ids)], device=model.device), cache)
        lens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        norms: dict[int, list[float]] = {}
        for layer in residual_layers:
            (residual,) = trace["residual", layer]
            flat = residual[0].flatten(-2) if model.config.hc_count else residual[0]  # [T, hidden]
            if layer in spec.logit_lens:
                logprobs = model.output(model.norm(flat)).float().log_softmax(-1)
                lens[layer] = logprobs.topk(spec.top_k, dim=-1)
            if layer in spec.residual_norm:
                norms[layer] = flat.float().norm(dim=-1).tolist()
        routed = {
            layer: (
                trace["router_experts", layer][0][0].tolist(),
                trace["router_weights", layer][0][0].tolist(),
            )
            for layer in spec.router
        }
    return [
        TokenProbe(
            position=start + i,
            token_id=token,
            text=_text(tokenizer, token),
            logit_lens={
                layer: tuple(
                    (t, _text(tokenizer, t), p)
                    for t, p in zip(ids_[i].tolist(), values[i].tolist(), strict=True)
                )
                for layer, (values, ids_) in lens.items()
            },
            router={
                layer: tuple(zip(experts[i], weights[i], strict=True))
                for layer, (experts, weights) in routed.items()
            },
            residual_norm={layer: values[i] for layer, values in norms.items()},
        )
        for i, token in enumerate(chosen)
    ]


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
