"""The `bubo_probe` request field: per-token captures of chosen layers returned with the answer, in every
dialect (research inspection over HTTP; bubo/engine/probes.py computes them). Served only with
--debug-hooks, which the CLI allows only on a loopback address: a probe costs a second pass over the
prompt and answer, and shows the model's internals.

    "bubo_probe": {"logit_lens": [10, 29], "router": [1], "residual_norm": [0], "top_k": 5}

Each list names layers (0-based); at least one list is non-empty; `top_k` (1-20, default 5) is how many
lens tokens each layer gives. The answer carries, at the top level of the JSON body (or of the stream's
last chunk or event):

    "bubo_probe": {"tokens": [{"id": 9159, "token": " Paris", "position": 4,
                               "logit_lens": {"29": [{"id": 9159, "token": " Paris", "logprob": -0.2}]},
                               "router": {"1": [{"expert": 3, "weight": 0.61}, ...]},
                               "residual_norm": {"0": 35.2}}]}

one entry per generated token (a final end token included), from the pass that chose it: `position` is
that pass's position (the prompt's last for the first token). The size is capped up front: the tokens
the request may generate (max_tokens, or what the context leaves) times the values per token (lens
layers x top_k + router layers x the model's experts per token + residual_norm layers) at most
MAX_PROBE_VALUES.
"""

from dataclasses import replace
from typing import Any

from bubo.engine.probes import ProbeSpec, TokenProbe, check_probe
from bubo.engine.request import Finished, GenerationRequest
from bubo.server.errors import ApiError, bad_field
from bubo.server.fields import Body
from bubo.server.state import ServerState

__all__ = ["MAX_PROBE_VALUES", "PROBE_FIELD", "probe_json", "with_probe"]

PROBE_FIELD = "bubo_probe"
MAX_PROBE_VALUES = 65536  # about 2 MB of JSON at most
MAX_TOP_K = 20
_KINDS = ("logit_lens", "router", "residual_norm")


def with_probe(generation: GenerationRequest, body: Body, state: ServerState) -> GenerationRequest:
    """`generation` with the probe the body asks for; 400 for a bad or too large one, or without
    --debug-hooks."""
    raw = body.raw(PROBE_FIELD)
    if raw is None:
        return generation
    if not state.settings.debug_hooks:
        raise ApiError(
            400,
            "debug_hooks_disabled",
            f"{PROBE_FIELD}: probes are served only by a server started with --debug-hooks",
            param=PROBE_FIELD,
        )
    spec = _spec(raw)
    loaded = state.require_ready()
    try:
        check_probe(loaded.model, spec)
    except ValueError as error:
        raise bad_field(PROBE_FIELD, str(error), "invalid_probe") from None
    if generation.images:
        raise bad_field(PROBE_FIELD, "a prompt with images can't be probed", "invalid_probe")
    limit = generation.params.token_limit
    tokens = state.n_ctx - len(generation.prompt_ids) if limit is None else limit
    per_token = spec.values_per_token(loaded.config.num_experts_per_tok or 0)
    if tokens * per_token > MAX_PROBE_VALUES:
        raise bad_field(
            PROBE_FIELD,
            f"{tokens} tokens x {per_token} values a token is {tokens * per_token} values, over the cap "
            f"of {MAX_PROBE_VALUES}: ask for fewer layers, a smaller top_k or a lower max_tokens",
            "probe_too_large",
        )
    return replace(generation, probe=spec)


def _spec(raw: Any) -> ProbeSpec:
    if not isinstance(raw, dict):
        raise bad_field(PROBE_FIELD, "must be an object", "invalid_probe")
    unknown = sorted(set(raw) - {*_KINDS, "top_k"})
    if unknown:
        raise bad_field(
            f"{PROBE_FIELD}.{unknown[0]}",
            f"unknown; a probe takes {', '.join(_KINDS)} and top_k",
            "invalid_probe",
        )
    top_k = raw.get("top_k", 5)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise bad_field(f"{PROBE_FIELD}.top_k", f"must be an integer from 1 to {MAX_TOP_K}", "invalid_probe")
    layers = {kind: _layers(raw.get(kind), kind) for kind in _KINDS}
    if not any(layers.values()):
        raise bad_field(
            PROBE_FIELD, f"asks for nothing: list layers in one of {', '.join(_KINDS)}", "invalid_probe"
        )
    return ProbeSpec(**layers, top_k=top_k)


def _layers(raw: Any, kind: str) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in raw):
        raise bad_field(f"{PROBE_FIELD}.{kind}", "must be an array of layer numbers", "invalid_probe")
    if len(set(raw)) != len(raw):
        raise bad_field(f"{PROBE_FIELD}.{kind}", "names a layer twice", "invalid_probe")
    return tuple(raw)


def probe_json(finished: Finished) -> dict[str, Any]:
    """{"bubo_probe": ...} for an answer whose request asked for a probe, else nothing: spread into the
    body or the stream's last chunk."""
    if finished.probe is None:
        return {}
    return {PROBE_FIELD: {"tokens": [_token(probe) for probe in finished.probe]}}


def _token(probe: TokenProbe) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": probe.token_id, "token": probe.text, "position": probe.position}
    if probe.logit_lens:
        entry["logit_lens"] = {
            str(layer): [{"id": t, "token": text, "logprob": p} for t, text, p in top]
            for layer, top in probe.logit_lens.items()
        }
    if probe.router:
        entry["router"] = {
            str(layer): [{"expert": e, "weight": w} for e, w in routed]
            for layer, routed in probe.router.items()
        }
    if probe.residual_norm:
        entry["residual_norm"] = {str(layer): norm for layer, norm in probe.residual_norm.items()}
    return entry
