"""Research inspection of a Decoder's eager forward: named capture sites saved per pass, and
interventions at the same sites, through forward hooks on the model's own modules (the math stays
written once, in the layers).

Sites, per layer (a `Trace` saves the ones it is asked for, for the layers it is asked for):
    residual        the residual after the layer [B, T, hidden] (qwen4exp: [B, T, hc, hidden], a
                    row per hyper-connection stream)
    attention       the token mixer's output [B, T, hidden] (attention, Gated DeltaNet or QSA)
    attention_probs a plain attention layer's weights [B, heads, T, keys] over every position so far,
                    computed by a reference path (Attention.probabilities: one more projection of
                    the queries and an explicit softmax), so asked for by layer; not in a batched
                    pass of several caches, whose rows' lengths differ
    mlp             the feed-forward's output [B, T, hidden] (dense MLP or mixture of experts)
    router          a mixture of experts' router: `router_logits` [B, T, experts] as the router
                    computed them, and the `router_experts` and `router_weights` [B, T, top_k] the
                    layer used (after any ablation)
    deltanet_state  a Gated DeltaNet's recurrent state after the pass [B, heads, dk, dv], value
                    heads in the file's order (qwen35 family: tiled, bubo/model/deltanet.py)
    logit_lens      the residual after the layer read through the model's own final norm (qwen4exp:
                    its stream mixer) and output head: float32 logits [B, T, vocab]
    indexer_keep    a QSA layer's indexer selection: bool [B, T, keys], the keys each query attends
                    to (the kept blocks and the tail, causal included)
    indexer_scores  a QSA layer's indexer block scores, float32 [B, T, blocks] over the complete blocks
                    so far, as the indexer ranked them: -inf where a block is not yet complete at the
                    query. Only a pass whose layer holds more complete blocks than the indexer's budget
                    scores them; a pass with fewer (a short prompt's prefill, its early decode steps)
                    attends to every block and saves nothing
    ngram_gates     the PLE layer's per-stream n-gram gates [B, T, hc]: sigmoid of the signed square
                    root, the weight in (0, 1) each stream gives the hashed n-gram value

And once per model, where it has an MTP block (`layers` does not apply):
    mtp_logits      each call of the MTP block (drafting, and taking in the prompt) read through its
                    head: float32 logits [B, T, vocab], named ("mtp_logits", k) for the step's k-th call

Each pass of the main layers (a prompt's prefill chunk, a decode step, a verify pass) is one `Step`.
Interventions (`add`, `scale`, `replace`, `patch`, `ablate_experts`) run at every step while the trace is
active; later sites and the captures see their effect. Hooks exist only while a trace is active: an
untraced model runs exactly as before. The compiled and captured decode steps bypass module hooks,
so the runner (bubo/engine/runner.py) runs a traced model eagerly (`is_traced`).
"""

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DecoderLayer, DeltaNetMixer, HyperConnectedLayer
from bubo.model.indexed_attention import QSAIndexer
from bubo.model.moe import SparseMoE, top_k_routing
from bubo.model.ngram_embedding import PLELayer
from bubo.model.state import CacheBatch, KVCache

__all__ = ["SITES", "TRACED_REASON", "Step", "Trace", "is_traced"]

SITES = (
    "residual",
    "attention",
    "attention_probs",
    "mlp",
    "router",
    "deltanet_state",
    "logit_lens",
    "indexer_keep",
    "indexer_scores",
    "ngram_gates",
    "mtp_logits",
)
# Sites captured once per step rather than per position (`Trace.tokens` can't join them).
STEP_SITES = ("attention_probs", "deltanet_state", "indexer_keep", "indexer_scores", "mtp_logits")
# The sites an intervention can change (experts are ablated with `ablate_experts`).
ACTIVATION_SITES = ("residual", "attention", "mlp")
TRACED_REASON = "traced: eager so every site is seen"

# What an intervention does to an activation at one step: the activation as the captures show it
# (qwen4exp's residual as [.., hc, hidden]) and the step -> its replacement, same shape.
Edit = Callable[[torch.Tensor, "Step"], torch.Tensor]

_active: "weakref.WeakKeyDictionary[Decoder, Trace]" = weakref.WeakKeyDictionary()


def is_traced(model: nn.Module) -> bool:
    """Whether a trace is active on `model` (its steps must run eagerly, through the hooks)."""
    return isinstance(model, Decoder) and model in _active


@dataclass
class Step:
    """One pass of the main layers: `tokens` new positions from `start` for `batch` sequences, and
    what was captured, by (capture name, layer)."""

    index: int
    start: int
    tokens: int
    batch: int
    captures: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


class Trace:
    """Captures `sites` of `layers` (None: every layer that has the site; or a mapping site -> layers)
    at every pass of `model` while active (`with`), and applies the interventions added to it."""

    def __init__(
        self,
        model: Decoder,
        sites: Iterable[str] = ("residual",),
        layers: Iterable[int] | Mapping[str, Iterable[int]] | None = None,
    ) -> None:
        self.model = model
        self.steps: list[Step] = []
        sites = (sites,) if isinstance(sites, str) else tuple(sites)
        for site in sites:
            _check_site(site, SITES)
        if isinstance(layers, Mapping):
            for site in layers:
                _check_site(site, sites)
        self._capture: dict[str, tuple[int, ...]] = {
            site: self._layers_with(site, layers.get(site) if isinstance(layers, Mapping) else layers)
            for site in sites
        }
        self._edits: dict[tuple[str, int], list[Edit]] = {}
        self._ablated: dict[int, torch.Tensor] = {}  # layer -> bool mask [experts]
        self._hooked: set[tuple[str, int]] = set()  # (site, layer) pairs whose hooks run while active
        self._handles: dict[tuple[str, int], RemovableHandle] = {}
        self._active = False

    # Lifecycle

    def __enter__(self) -> "Trace":
        if self.model in _active:
            raise RuntimeError("this model is traced already: one trace at a time")
        _active[self.model] = self
        self._active = True
        first = self.model.layers[0]
        self._handles["step", 0] = first.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        for site, layers in self._capture.items():
            self._hooked.update((site, layer) for layer in layers)
        for site, layer in sorted(self._hooked):
            self._hook(site, layer)
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._active = False
        _active.pop(self.model, None)

    # Interventions

    def add(self, site: str, vector: torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """Add `vector` to the activation at `site` of `layers` at every position and step (steering):
        [hidden] (to every qwen4exp stream), or anything that broadcasts to the activation."""
        self._check_vector(site, vector)
        self._edit(site, layers, lambda x, _: x + vector.to(x.device, x.dtype))

    def scale(self, site: str, factor: float | torch.Tensor, layers: Iterable[int] | None = None) -> None:
        """Multiply the activation at `site` of `layers` by `factor` (0 ablates it)."""
        if isinstance(factor, torch.Tensor):
            self._check_vector(site, factor)
            scales = factor
            self._edit(site, layers, lambda x, _: x * scales.to(x.device, x.dtype))
        else:
            self._edit(site, layers, lambda x, _: x * factor)

    def replace(self, site: str, value: torch.Tensor | Edit, layers: Iterable[int] | None = None) -> None:
        """Replace the activation at `site` of `layers`: by `value` broadcast to its shape, or by what
        `value(activation, step)` returns (patching from another run's captures)."""
        if isinstance(value, torch.Tensor):
            self._check_vector(site, value)
            self._edit(site, layers, lambda x, _: value.to(x.device, x.dtype).expand_as(x).clone())
        else:
            self._edit(site, layers, value)

    def patch(self, site: str, donor: "Trace", layers: Iterable[int] | None = None) -> None:
        """Replace the activation at `site` of `layers` at each step by what `donor`, the trace of
        another run that captured `site` there, saved at the same step (activation patching): this
        run goes on from the donor's activations. The two runs' steps must match in shape."""
        _check_site(site, ACTIVATION_SITES)
        for layer in self._layers_with(site, layers):
            self._edit(site, [layer], _patched(site, layer, donor[site, layer]))

    def ablate_experts(self, experts: Iterable[int], layers: Iterable[int] | None = None) -> None:
        """Take `experts` out of the mixture-of-experts layers `layers` (None: all): their router logits
        become -inf, so the router's softmax, top-k and renormalisation run over the other experts."""
        chosen, ids = self._layers_with("router", layers), sorted(set(int(e) for e in experts))
        count = self.model.config.num_experts
        if not ids or any(not 0 <= e < count for e in ids):
            raise ValueError(f"experts to ablate must be ids in [0, {count}), got {ids}")
        for layer in chosen:
            moe = self.model.layers[layer].mlp
            assert isinstance(moe, SparseMoE)
            mask = self._ablated.get(
                layer, torch.zeros(count, dtype=torch.bool, device=self.model.device)
            ).clone()
            mask[ids] = True
            if count - int(mask.sum()) < moe.top_k:
                raise ValueError(
                    f"ablating {int(mask.sum())} of {count} experts leaves fewer than top_k {moe.top_k}"
                )
            self._ablated[layer] = mask
            self._hook("router", layer)

    # Results

    def __getitem__(self, key: tuple[str, int]) -> list[torch.Tensor]:
        """The captures named `key` = (name, layer), one per step that saved it: a site's name, or for
        the router `router_logits`, `router_experts`, `router_weights`; ("mtp_logits", k) is the k-th
        MTP call of each step that made one."""
        found = [step.captures[key] for step in self.steps if key in step.captures]
        if not found:
            raise KeyError(f"nothing captured as {key!r}; captured: {sorted(self.names())}")
        return found

    def tokens(self, name: str, layer: int) -> torch.Tensor:
        """The per-position captures `name` of `layer` of every step joined along the positions (dim 1):
        a prefill and its decode steps as one sequence."""
        if name in STEP_SITES:
            raise ValueError(f"{name} is captured whole per step, not per position: index the steps")
        return torch.cat(self[name, layer], dim=1)

    def names(self) -> set[tuple[str, int]]:
        return {key for step in self.steps for key in step.captures}

    # Hooks

    def _layers_with(self, site: str, layers: Iterable[int] | None) -> tuple[int, ...]:
        """`layers` checked against the model (None: those that have `site`)."""
        if site == "mtp_logits":
            if self.model.mtp is None:
                raise ValueError(f"this {self.model.config.architecture} model has no MTP block")
            return (0,)  # the one block: its captures are numbered by call, not by layer
        count = len(self.model.layers)
        if layers is None:
            found = tuple(i for i in range(count) if _has_site(self.model.layers[i], site))
            if not found:
                raise ValueError(f"no layer of this {self.model.config.architecture} model has a {site} site")
            return found
        chosen = tuple(sorted(set(int(i) for i in layers)))
        for i in chosen:
            if not 0 <= i < count:
                raise ValueError(f"layer {i} is out of range: the model has {count} layers")
            if not _has_site(self.model.layers[i], site):
                raise ValueError(f"layer {i} has no {site} site")
        return chosen

    def _check_vector(self, site: str, vector: torch.Tensor) -> None:
        _check_site(site, ACTIVATION_SITES)
        hidden = self.model.config.hidden_size
        if vector.dim() == 0 or vector.shape[-1] != hidden:
            raise ValueError(
                f"a {site} intervention's last dimension must be the hidden size {hidden}, "
                f"got shape {tuple(vector.shape)}"
            )

    def _edit(self, site: str, layers: Iterable[int] | None, edit: Edit) -> None:
        _check_site(site, ACTIVATION_SITES)
        for layer in self._layers_with(site, layers):
            self._edits.setdefault((site, layer), []).append(edit)
            self._hook(site, layer)

    def _hook(self, site: str, layer: int) -> None:
        """Install the hook that serves `site` of `layer` (once; now if active, else on entry)."""
        self._hooked.add((site, layer))
        module = self.model.mtp if site == "mtp_logits" else _site_module(self.model.layers[layer], site)
        key = (_HOOKED[site], layer)
        if not self._active or key in self._handles:
            return
        hook = getattr(self, f"_on_{_HOOKED[site]}")
        self._handles[key] = module.register_forward_hook(
            lambda mod, args, kwargs, output: hook(layer, mod, args, kwargs, output), with_kwargs=True
        )

    def _begin_step(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x, cache = args[0], args[3]
        start = cache.caches[0].length if isinstance(cache, CacheBatch) else cache.length
        self.steps.append(Step(len(self.steps), start, x.shape[1], x.shape[0]))

    def _save(self, site: str, layer: int, value: torch.Tensor, name: str | None = None) -> None:
        """Keep a copy of `value` as (`name`, default the site's, `layer`) where `site` is captured there."""
        if layer in self._capture.get(site, ()):
            self.steps[-1].captures[name or site, layer] = value.detach().clone()

    def _apply(self, site: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        for edit in self._edits.get((site, layer), ()):
            x = edit(x, self.steps[-1])
        return x

    def _on_layer(self, layer: int, _: nn.Module, __: Any, ___: Any, output: torch.Tensor) -> torch.Tensor:
        hc = self.model.config.hc_count
        streams = output.unflatten(-1, (hc, -1)) if hc else output
        streams = self._apply("residual", layer, streams)
        self._save("residual", layer, streams)
        output = streams.flatten(-2) if hc else streams
        if layer in self._capture.get("logit_lens", ()):
            self._save("logit_lens", layer, self.model.output(self.model.norm(output)).float())
        return output

    def _on_attention(
        self, layer: int, _: nn.Module, __: Any, ___: Any, output: torch.Tensor
    ) -> torch.Tensor:
        output = self._apply("attention", layer, output)
        self._save("attention", layer, output)
        return output

    def _on_mlp(self, layer: int, _: nn.Module, __: Any, ___: Any, output: torch.Tensor) -> torch.Tensor:
        output = self._apply("mlp", layer, output)
        self._save("mlp", layer, output)
        return output

    def _on_router(self, layer: int, _: nn.Module, __: Any, ___: Any, logits: torch.Tensor) -> torch.Tensor:
        moe = self.model.layers[layer].mlp
        assert isinstance(moe, SparseMoE)
        batch = self.steps[-1].batch
        self._save("router", layer, logits.unflatten(0, (batch, -1)), "router_logits")
        mask = self._ablated.get(layer)
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
        if layer in self._capture.get("router", ()):
            weights, experts = top_k_routing(logits, moe.top_k, moe.norm_topk_prob)
            self._save("router", layer, experts.unflatten(0, (batch, -1)), "router_experts")
            self._save("router", layer, weights.unflatten(0, (batch, -1)), "router_weights")
        return logits

    def _on_probs(
        self, layer: int, attention: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _: torch.Tensor
    ) -> None:
        assert isinstance(attention, Attention)
        x, cos, sin, cache = args[:4]
        if not isinstance(cache, KVCache):
            return
        last_only = kwargs.get("last_only", args[4] if len(args) > 4 else False)
        # A last_only pass (the end of a generation's prompt) ran the last position's query alone.
        queries_from = x.shape[1] - 1 if last_only else 0
        self._save("attention_probs", layer, attention.probabilities(x, cos, sin, cache, queries_from))

    def _on_indexer(self, layer: int, _: nn.Module, __: Any, ___: Any, keep: torch.Tensor) -> None:
        self._save("indexer_keep", layer, keep)

    def _on_scores(self, layer: int, _: nn.Module, __: Any, ___: Any, scores: torch.Tensor) -> None:
        self._save("indexer_scores", layer, scores)

    def _on_gates(self, layer: int, _: nn.Module, __: Any, ___: Any, gates: torch.Tensor) -> None:
        self._save("ngram_gates", layer, gates.squeeze(-1))

    def _on_mtp(self, _: int, __: nn.Module, ___: Any, ____: Any, output: tuple[torch.Tensor, ...]) -> None:
        if not self.steps:
            return  # the block run on its own before any pass of the main layers: no step to file it in
        captures = self.steps[-1].captures
        calls = sum(1 for name, _ in captures if name == "mtp_logits")
        captures["mtp_logits", calls] = self.model.draft_head(output[0]).detach()

    def _on_deltanet(
        self, layer: int, mixer: nn.Module, args: tuple[Any, ...], _: Any, __: torch.Tensor
    ) -> None:
        assert isinstance(mixer, DeltaNetMixer)
        cache = args[3]
        caches = cache.caches if isinstance(cache, CacheBatch) else [cache]
        assert all(isinstance(c, KVCache) for c in caches)
        state = torch.cat([c.recurrent[mixer.state_index].recurrent_state for c in caches])
        self._save("deltanet_state", layer, state)


# Which hook serves each site: the residual's also computes the logit lens.
_HOOKED = {
    "residual": "layer",
    "logit_lens": "layer",
    "attention": "attention",
    "attention_probs": "probs",
    "mlp": "mlp",
    "router": "router",
    "deltanet_state": "deltanet",
    "indexer_keep": "indexer",
    "indexer_scores": "scores",
    "ngram_gates": "gates",
    "mtp_logits": "mtp",
}


def _patched(site: str, layer: int, saved: list[torch.Tensor]) -> Edit:
    """The edit that puts `saved[step]` (a donor's captures, one per step) in place of the activation."""

    def edit(x: torch.Tensor, step: Step) -> torch.Tensor:
        if step.index >= len(saved):
            raise ValueError(
                f"the donor run has {len(saved)} steps of {site} at layer {layer}, no step {step.index}"
            )
        value = saved[step.index]
        if value.shape != x.shape:
            raise ValueError(
                f"step {step.index}: the donor's {site} at layer {layer} has shape {tuple(value.shape)}, "
                f"this run's {tuple(x.shape)}"
            )
        return value.to(x.device, x.dtype)

    return edit


def _check_site(site: str, allowed: Iterable[str]) -> None:
    if site not in allowed:
        raise ValueError(f"unknown site {site!r}: one of {', '.join(allowed)}")


def _has_site(layer: nn.Module, site: str) -> bool:
    if site == "router":
        return isinstance(getattr(layer, "mlp", None), SparseMoE)
    if site == "deltanet_state":
        return isinstance(getattr(layer, "attention", None), DeltaNetMixer)
    if site == "attention_probs":
        return isinstance(getattr(layer, "attention", None), Attention)
    if site in ("indexer_keep", "indexer_scores"):
        return any(isinstance(module, QSAIndexer) for module in layer.modules())
    if site == "ngram_gates":
        return isinstance(getattr(layer, "ple", None), PLELayer)
    return isinstance(layer, DecoderLayer | HyperConnectedLayer)


def _site_module(layer: nn.Module, site: str) -> nn.Module:
    kind = _HOOKED[site]
    if kind == "layer":
        return layer
    if kind == "router":
        return layer.mlp.router
    if kind in ("deltanet", "probs"):
        return layer.attention
    if kind in ("indexer", "scores"):
        indexer = next(module for module in layer.modules() if isinstance(module, QSAIndexer))
        return indexer if kind == "indexer" else indexer.score_probe
    if kind == "gates":
        return layer.ple.gate_probe
    return getattr(layer, kind)
