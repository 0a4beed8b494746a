"""Research inspection (bubo/model/trace.py): captures equal transformers' own outputs on tiny float32
models (hidden states, router logits and choices, the Gated DeltaNet state), the logit lens reads the
model's own head, interventions change exactly what they say, and hooks are gone after the trace."""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen4ExpForCausalLM,
    Qwen4ExpTextConfig,
)

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.trace import Trace, is_traced
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.fixtures.mtp_models import mtp_model
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers, the logit tests' bound (TESTING.md)
BATCH, PREFILL, DECODE = 2, 9, 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _eager(model: PreTrainedModel) -> PreTrainedModel:
    model.config._attn_implementation = "eager"
    randomize_(model)
    return model.eval()


def _llama() -> PreTrainedModel:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return _eager(LlamaForCausalLM(config))


def _qwen3moe() -> PreTrainedModel:
    config = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return _eager(Qwen3MoeForCausalLM(config))


def _bubo(reference: PreTrainedModel, path: Path) -> Decoder:
    f = GGUFFile(write_gguf(reference, path))
    return load_decoder(f, config_from_gguf(f))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, PREFILL + DECODE), generator=torch.Generator().manual_seed(2))


def _run(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """A prefill of PREFILL tokens, then one decode step per remaining token: logits [B, T, vocab]."""
    cache = model.new_cache(batch=tokens.shape[0], max_len=tokens.shape[1])
    with torch.inference_mode():
        pieces = [model(tokens[:, :PREFILL], cache)]
        pieces += [model(tokens[:, i : i + 1], cache) for i in range(PREFILL, tokens.shape[1])]
    return torch.cat(pieces, dim=1)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Decoder]:
    reference = _llama()
    return reference, _bubo(reference, tmp_path_factory.mktemp("trace") / "llama.gguf")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Decoder]:
    reference = _qwen3moe()
    return reference, _bubo(reference, tmp_path_factory.mktemp("trace") / "moe.gguf")


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Decoder]:
    reference = _eager(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_QWEN4EXP_CONFIG)))
    f = GGUFFile(write_qwen4exp_gguf(reference, tmp_path_factory.mktemp("trace") / "qwen4exp.gguf"))
    return reference, load_decoder(f, config_from_gguf(f))


def _steps(trace: Trace) -> list[tuple[int, int, int]]:
    return [(step.start, step.tokens, step.batch) for step in trace.steps]


STEPS = [(0, PREFILL, BATCH)] + [(i, 1, BATCH) for i in range(PREFILL, PREFILL + DECODE)]


def test_residuals_are_transformers_hidden_states_at_every_step(
    llama: tuple[PreTrainedModel, Decoder],
) -> None:
    reference, model = llama
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True).hidden_states
    with Trace(model, sites=["residual", "logit_lens"]) as trace:
        logits = _run(model, tokens)
    assert _steps(trace) == STEPS
    last = len(model.layers) - 1
    for layer in range(last):
        # hidden_states[0] is the embedding, [i + 1] the residual after layer i
        assert _diff(trace.tokens("residual", layer), expected[layer + 1]) <= TOLERANCE
    # transformers' last hidden state is after the final norm
    with torch.no_grad():
        assert _diff(model.norm(trace.tokens("residual", last)), expected[-1]) <= TOLERANCE
        lens = reference.lm_head(reference.model.norm(expected[1]))
    # The lens of the last layer is the model's output; earlier ones read through the same head.
    torch.testing.assert_close(trace.tokens("logit_lens", last), logits, rtol=0, atol=1e-5)
    assert _diff(trace.tokens("logit_lens", 0), lens) <= TOLERANCE


def test_attention_probabilities_are_transformers_attentions(llama: tuple[PreTrainedModel, Decoder]) -> None:
    """The prefill's [T, T] weights, and each decode step's row over the cache, against the eager
    reference's `output_attentions` rows at the same positions."""
    reference, model = llama
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens, output_attentions=True).attentions
    with Trace(model, sites=["attention_probs"], layers=[0, 2]) as trace:
        _run(model, tokens)
    heads = model.config.num_heads
    for layer in (0, 2):
        prefill, *decode = trace["attention_probs", layer]
        assert prefill.shape == (BATCH, heads, PREFILL, PREFILL)
        assert _diff(prefill, expected[layer][:, :, :PREFILL, :PREFILL]) <= TOLERANCE
        for step, probs in zip(trace.steps[1:], decode, strict=True):
            assert probs.shape == (BATCH, heads, 1, step.start + 1)
            assert _diff(probs[:, :, 0], expected[layer][:, :, step.start, : step.start + 1]) <= TOLERANCE
    with pytest.raises(ValueError, match="whole per step"):
        trace.tokens("attention_probs", 0)


def test_router_captures_are_transformers_router_outputs(moe: tuple[PreTrainedModel, Decoder]) -> None:
    reference, model = moe
    tokens = _tokens(reference.config.vocab_size)
    routed: dict[int, tuple[torch.Tensor, ...]] = {}
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _, __, out, i=i: routed.__setitem__(i, out))
        for i, layer in enumerate(reference.model.layers)
    ]
    with torch.no_grad():
        expected = reference(tokens, output_router_logits=True).router_logits
    for handle in handles:
        handle.remove()
    with Trace(model, sites=["router"], layers=[0, 1]) as trace:
        _run(model, tokens)
    assert _steps(trace) == STEPS
    for layer, logits in enumerate(expected):
        _, weights, experts = routed[layer]
        assert _diff(trace.tokens("router_logits", layer), logits.view(BATCH, -1, 8)) <= TOLERANCE
        assert torch.equal(trace.tokens("router_experts", layer), experts.view(BATCH, -1, 2))
        assert _diff(trace.tokens("router_weights", layer), weights.view(BATCH, -1, 2)) <= TOLERANCE


def _hybrid_state_after(reference: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' recurrent state of layer 0 (a linear-attention layer) after `tokens`."""
    with torch.no_grad():
        cache = reference(tokens, use_cache=True).past_key_values
    return cache.layers[0].recurrent_states[0]


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_deltanet_state_is_transformers_recurrent_state(arch: str, tmp_path: Path) -> None:
    """The state after the prefill and after the last decode step. qwen35-family files hold the value
    heads tiled (bubo/model/deltanet.py): the captures keep the file's order, head j from key head j % Hk."""
    reference = tiny_hybrid(arch, ["linear_attention", "full_attention"])
    randomize_(reference)
    model = _bubo(reference, tmp_path / "hybrid.gguf")
    tokens = _tokens(reference.config.vocab_size)
    sites = ["deltanet_state", "router"] if arch == "qwen3next" else ["deltanet_state"]
    with Trace(model, sites=sites) as trace:
        _run(model, tokens)
    assert _steps(trace) == STEPS
    states = trace["deltanet_state", 0]
    heads = reference.config.linear_num_value_heads
    order = torch.arange(heads)
    if arch == "qwen35":
        keys = reference.config.linear_num_key_heads
        order = order.view(keys, heads // keys).t().reshape(-1)  # grouped head j sits at tiled order[j]
    for state, seen in ((states[0], tokens[:, :PREFILL]), (states[-1], tokens)):
        assert state.shape == (BATCH, heads, 16, 16)
        assert _diff(state[:, order], _hybrid_state_after(reference, seen)) <= TOLERANCE
    assert ("deltanet_state", 1) not in trace.names()  # layer 1 is full attention
    if arch == "qwen3next":  # a mixture of experts with a shared expert in every layer
        assert {name for name, _ in trace.names()} >= {"router_logits", "router_experts", "router_weights"}


def test_qwen4exp_streams_router_and_lens_are_transformers(
    qwen4exp: tuple[PreTrainedModel, Decoder],
) -> None:
    """Every hyper-connection stream of the residual, the router logits, and the lens through the
    stream mixer, against transformers' hidden states, router logits and output."""
    reference, model = qwen4exp
    hc, hidden = model.config.hc_count, model.config.hidden_size
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True, output_router_logits=True)
    last = len(model.layers) - 1
    with Trace(model, sites=["residual", "router", "logit_lens"], layers=[0, 3, last]) as trace:
        logits = _run(model, tokens)
    assert _steps(trace) == STEPS
    for layer in (0, 3):
        streams = trace.tokens("residual", layer)
        assert streams.shape == (BATCH, PREFILL + DECODE, hc, hidden)
        assert _diff(streams.flatten(-2), expected.hidden_states[layer + 1]) <= TOLERANCE
    for layer in (0, 3, last):
        router = expected.router_logits[layer].view(BATCH, PREFILL + DECODE, -1)
        assert _diff(trace.tokens("router_logits", layer), router) <= TOLERANCE
    torch.testing.assert_close(trace.tokens("logit_lens", last), logits, rtol=0, atol=1e-5)
    assert _diff(logits, expected.logits) <= TOLERANCE


QSA_PREFILL, QSA_DECODE = 20, 3  # 5 complete blocks at the prefill's end: more than the budget's 2


def _qsa_tokens() -> torch.Tensor:
    return torch.randint(
        0, 2048, (BATCH, QSA_PREFILL + QSA_DECODE), generator=torch.Generator().manual_seed(6)
    )


def _run_qsa(model: Decoder, tokens: torch.Tensor) -> None:
    """A prefill of QSA_PREFILL tokens, then one decode step per remaining token."""
    cache = model.new_cache(batch=BATCH, max_len=tokens.shape[1])
    with torch.inference_mode():
        model(tokens[:, :QSA_PREFILL], cache)
        for i in range(QSA_PREFILL, tokens.shape[1]):
            model(tokens[:, i : i + 1], cache)


def test_qsa_indexer_selection_is_transformers(qwen4exp: tuple[PreTrainedModel, Decoder]) -> None:
    """The keys each query of a QSA layer attends to (kept blocks and tail), at a prefill long enough for
    the indexer to choose and at each decode step, against transformers' indexer output."""
    reference, model = qwen4exp
    prefill, decode = QSA_PREFILL, QSA_DECODE
    tokens = _qsa_tokens()
    indexers = [m for m in reference.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    selected: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _, __, out: selected.append(out[:, 0])) for m in indexers]
    try:
        with torch.no_grad():
            reference(tokens)
    finally:
        for handle in handles:
            handle.remove()
    with Trace(model, sites=["indexer_keep"]) as trace:
        _run_qsa(model, tokens)
    layers = sorted(layer for name, layer in trace.names() if name == "indexer_keep")
    assert len(layers) == len(indexers) > 0
    for layer, expected in zip(layers, selected, strict=True):
        first, *steps = trace["indexer_keep", layer]
        assert torch.equal(first, expected[:, :prefill, :prefill])
        # The indexer kept fewer keys than the causal mask allows somewhere: it chose.
        assert first.sum() < torch.ones(prefill, prefill).tril().sum() * BATCH
        for i, keep in zip(range(prefill, prefill + decode), steps, strict=True):
            assert torch.equal(keep[:, 0], expected[:, i, : i + 1])


@contextmanager
def _spy_inside(modules: list[nn.Module], function: str) -> Iterator[list[torch.Tensor]]:
    """The first argument of every call of torch.`function` made while one of `modules` runs its forward:
    how a test reads a value transformers computes inside a forward and returns nothing of."""
    seen: list[torch.Tensor] = []
    real = getattr(torch, function)

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(x.clone())
        return real(x, *args, **kwargs)

    handles = [
        handle
        for module in modules
        for handle in (
            module.register_forward_pre_hook(lambda *_: setattr(torch, function, spy)),
            module.register_forward_hook(lambda *_: setattr(torch, function, real)),
        )
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        setattr(torch, function, real)


def test_qsa_indexer_scores_and_ngram_gates_are_transformers(
    qwen4exp: tuple[PreTrainedModel, Decoder],
) -> None:
    """The QSA indexer's block scores and the PLE layer's n-gram gates, at a prefill long enough for the
    indexer to choose and at each decode step, against what transformers' indexer and PLE layer compute
    (read from their relu and sigmoid calls); a pass of no more blocks than the budget scores none."""
    reference, model = qwen4exp
    config = reference.config
    tokens = _qsa_tokens()
    length, ratio = tokens.shape[1], config.indexer_compress_ratio
    indexers = [m for m in reference.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    ples = [m for m in reference.modules() if type(m).__name__ == "Qwen4ExpTextPLELayer"]
    with _spy_inside(indexers, "relu") as products, _spy_inside(ples, "sigmoid") as gates, torch.no_grad():
        reference(tokens)
    # transformers scores query t's (t + 1) // ratio complete blocks alone, one [blocks, heads] product
    # per query, batch row by batch row; blocks completed after the query read -inf.
    expected = torch.full((len(indexers), BATCH, length, length // ratio), float("-inf"))
    found = iter(products)
    for k in range(len(indexers)):
        for b in range(BATCH):
            for t in range(ratio - 1, length):
                row = next(found).relu().sum(-1) / math.sqrt(config.indexer_head_dim)
                expected[k, b, t, : (t + 1) // ratio] = row
    assert next(found, None) is None

    with Trace(model, sites=["indexer_scores", "ngram_gates"]) as trace:
        _run_qsa(model, tokens)
        budget = config.indexer_budget  # as many tokens as make the budget's blocks: nothing to choose
        with torch.inference_mode():
            model(tokens[:, :budget], model.new_cache(batch=BATCH, max_len=budget))
    layers = sorted(layer for name, layer in trace.names() if name == "indexer_scores")
    assert len(layers) == len(indexers) > 0
    for layer, want in zip(layers, expected, strict=True):
        first, *steps = trace["indexer_scores", layer]  # the short pass saved none
        blocks = QSA_PREFILL // ratio
        torch.testing.assert_close(first, want[:, :QSA_PREFILL, :blocks], rtol=0, atol=TOLERANCE)
        for i, scores in zip(range(QSA_PREFILL, length), steps, strict=True):
            torch.testing.assert_close(scores, want[:, i : i + 1, : (i + 1) // ratio], rtol=0, atol=TOLERANCE)

    (ple_layer,) = {layer for name, layer in trace.names() if name == "ngram_gates"}
    assert ple_layer == config.ple_layer_ids[0] - 1  # 1-based in the HF config
    (gate,) = gates  # the layer's one sigmoid: of its signed-square-root gate [B, T, hc, 1]
    captured = torch.cat(trace["ngram_gates", ple_layer][: 1 + QSA_DECODE], dim=1)
    assert captured.shape == (BATCH, length, model.config.hc_count)
    assert _diff(captured, torch.sigmoid(gate).squeeze(-1)) <= TOLERANCE


def test_mtp_logits_are_each_draft_calls_logits(
    tmp_path: Path, llama: tuple[PreTrainedModel, Decoder]
) -> None:
    """Every call of the MTP block in a step is captured, numbered in order, as the logits it drafts."""
    _, path = mtp_model("qwen3next", ["linear_attention", "full_attention"], tmp_path / "mtp.gguf")
    f = GGUFFile(path)
    model = load_decoder(f, config_from_gguf(f))
    tokens = _tokens(model.config.vocab_size)[:, :PREFILL]
    with Trace(model, sites=["mtp_logits"]) as trace, torch.inference_mode():
        _, hidden = model.hidden_and_mtp_input(tokens[:, :-1], model.new_cache(batch=BATCH, max_len=PREFILL))
        mtp_cache = model.new_mtp_cache(batch=BATCH, max_len=PREFILL)
        first = model.draft_logits(hidden[:, :4], tokens[:, 1:5], mtp_cache)
        second = model.draft_logits(hidden[:, 4:], tokens[:, 5:], mtp_cache)
    assert trace.names() == {("mtp_logits", 0), ("mtp_logits", 1)} and len(trace.steps) == 1
    torch.testing.assert_close(trace["mtp_logits", 0][0], first, rtol=0, atol=0)
    torch.testing.assert_close(trace["mtp_logits", 1][0], second, rtol=0, atol=0)
    with pytest.raises(ValueError, match="llama model has no MTP block"):
        Trace(llama[1], sites=["mtp_logits"])


def _lens(model: Decoder, residual: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.output(model.norm(residual)).float()


def test_steering_adds_to_the_residual_at_every_step(llama: tuple[PreTrainedModel, Decoder]) -> None:
    reference, model = llama
    tokens, last = _tokens(reference.config.vocab_size), len(model.layers) - 1
    with Trace(model, sites=["residual"]) as base:
        _run(model, tokens)
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with Trace(model, sites=["residual"]) as steered:
        steered.add("residual", direction, layers=[last])
        logits = _run(model, tokens)
    expected = base.tokens("residual", last) + direction
    torch.testing.assert_close(steered.tokens("residual", last), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, _lens(model, expected), rtol=0, atol=1e-5)
    # Earlier layers are untouched; a steer at layer 0 reaches every later one.
    torch.testing.assert_close(steered.tokens("residual", 0), base.tokens("residual", 0), rtol=0, atol=0)
    with Trace(model, sites=["residual"]) as early:
        early.add("residual", direction, layers=[0])
        _run(model, tokens)
    assert _diff(early.tokens("residual", last), base.tokens("residual", last)) > 1e-2


def test_zeroed_blocks_leave_the_residual_as_it_came(llama: tuple[PreTrainedModel, Decoder]) -> None:
    """Scaling the last layer's attention and MLP outputs by 0 makes the output the lens of the layer
    before; scaling by 1 changes nothing."""
    reference, model = llama
    tokens, last = _tokens(reference.config.vocab_size), len(model.layers) - 1
    plain = _run(model, tokens)
    with Trace(model, sites=["logit_lens"], layers=[last - 1]) as trace:
        trace.scale("attention", 1.0)
        trace.scale("mlp", 1.0)
        torch.testing.assert_close(_run(model, tokens), plain, rtol=0, atol=0)
    with Trace(model, sites=["attention", "mlp"], layers={"attention": [last], "mlp": [last]}) as zeroed:
        zeroed.scale("attention", 0.0, layers=[last])
        zeroed.scale("mlp", 0.0, layers=[last])
        logits = _run(model, tokens)
    assert not zeroed.tokens("attention", last).any() and not zeroed.tokens("mlp", last).any()
    torch.testing.assert_close(logits, trace.tokens("logit_lens", last - 1), rtol=0, atol=1e-5)


def test_patching_a_residual_from_another_run(llama: tuple[PreTrainedModel, Decoder]) -> None:
    """Layer 0's residual replaced step by step with a donor run's: every later layer computes the
    donor's, so the output is the donor's logits."""
    reference, model = llama
    tokens = _tokens(reference.config.vocab_size)
    donor_tokens = (tokens + 7) % reference.config.vocab_size
    with Trace(model, sites=["residual"], layers=[0]) as donor:
        donor_logits = _run(model, donor_tokens)
    patch = donor["residual", 0]
    with Trace(model, sites=[]) as patched:
        patched.replace("residual", lambda _, step: patch[step.index], layers=[0])
        logits = _run(model, tokens)
    torch.testing.assert_close(logits, donor_logits, rtol=0, atol=1e-5)
    assert _diff(logits, _run(model, tokens)) > 1e-2
    # The same with the donor's trace handed over whole.
    with Trace(model, sites=[]) as patched:
        patched.patch("residual", donor, layers=[0])
        torch.testing.assert_close(_run(model, tokens), donor_logits, rtol=0, atol=1e-5)
    with Trace(model, sites=[]) as short:
        short.patch("residual", donor, layers=[0])
        cache = model.new_cache(batch=BATCH, max_len=PREFILL + 1)
        with pytest.raises(ValueError, match="donor's residual at layer 0 has shape"), torch.inference_mode():
            model(tokens[:, : PREFILL + 1], cache)
    with pytest.raises(KeyError, match="nothing captured as \\('residual', 1\\)"):
        Trace(model, sites=[]).patch("residual", donor, layers=[1])


def _masked_router(
    gate: torch.nn.Module, experts: list[int]
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """transformers' Qwen3MoeTopKRouter.forward with `experts`' logits set to -inf before its softmax."""

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
        logits[:, experts] = float("-inf")
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, chosen = torch.topk(probs, gate.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen

    return forward


def test_an_ablated_expert_is_its_router_logit_at_minus_infinity(
    moe: tuple[PreTrainedModel, Decoder],
) -> None:
    """Ablating the expert layer 1 routes to most equals transformers with that expert's router logit
    set to -inf, at the prefill and every decode step."""
    reference, model = moe
    tokens = _tokens(reference.config.vocab_size)
    with Trace(model, sites=["router"], layers=[1]) as plain:
        _run(model, tokens)
    busiest = int(plain.tokens("router_experts", 1).flatten().bincount().argmax())
    with Trace(model, sites=[]) as trace:
        trace.ablate_experts([busiest], layers=[1])
        logits = _run(model, tokens)
    gate = reference.model.layers[1].mlp.gate
    gate.forward = _masked_router(gate, [busiest])
    try:
        with torch.no_grad():
            expected = reference(tokens).logits
    finally:
        del gate.forward
    assert _diff(logits, expected) <= TOLERANCE
    with torch.no_grad():
        assert _diff(logits, reference(tokens).logits) > 1e-2


def test_ablated_experts_are_never_routed_to(moe: tuple[PreTrainedModel, Decoder]) -> None:
    """With all but experts 2 and 5 ablated, every token takes both, weighted by their renormalised
    router probabilities (norm_topk_prob), and the output changes."""
    reference, model = moe
    tokens = _tokens(reference.config.vocab_size)
    plain = _run(model, tokens)
    with Trace(model, sites=["router"]) as trace:
        trace.ablate_experts([0, 1, 3, 4, 6, 7], layers=[1])
        logits = _run(model, tokens)
    experts, weights = trace.tokens("router_experts", 1), trace.tokens("router_weights", 1)
    assert torch.equal(experts.sort(dim=-1).values, torch.tensor([2, 5]).expand_as(experts))
    router = trace.tokens("router_logits", 1)  # as the router computed them, before the ablation
    expected = torch.softmax(router.gather(-1, experts), dim=-1)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
    assert not torch.equal(trace.tokens("router_experts", 0).sort(-1).values, experts.sort(-1).values)
    assert _diff(logits, plain) > 1e-3


def test_bad_requests_are_refused(
    llama: tuple[PreTrainedModel, Decoder], moe: tuple[PreTrainedModel, Decoder]
) -> None:
    _, model = llama
    with pytest.raises(ValueError, match="unknown site 'resid'"):
        Trace(model, sites=["resid"])
    with pytest.raises(ValueError, match="layer 3 is out of range: the model has 3 layers"):
        Trace(model, layers=[3])
    with pytest.raises(ValueError, match="has a router site"):
        Trace(model, sites=["router"])
    with Trace(model) as trace:
        with pytest.raises(ValueError, match="hidden size 64"):
            trace.add("residual", torch.ones(3))
        with pytest.raises(ValueError, match="unknown site 'router'"):
            trace.scale("router", 0.0)
        with pytest.raises(RuntimeError, match="one trace at a time"):
            Trace(model).__enter__()
    _, sparse = moe
    with pytest.raises(ValueError, match=r"ids in \[0, 8\)"):
        Trace(sparse).ablate_experts([8])
    with pytest.raises(ValueError, match="fewer than top_k 2"):
        Trace(sparse).ablate_experts(range(7))


def test_no_hook_is_left_after_the_trace(moe: tuple[PreTrainedModel, Decoder]) -> None:
    _, model = moe
    with Trace(model, sites=["residual", "attention", "mlp", "router", "logit_lens"]) as trace:
        trace.add("residual", torch.ones(model.config.hidden_size))
        trace.ablate_experts([0])
        assert is_traced(model)
        assert sum(len(m._forward_hooks) for m in model.modules()) > 0
    assert not is_traced(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with Trace(model, sites="mlp", layers=[1]) as one:  # a site's name alone is one site
        _run(model, _tokens(300)[:, : PREFILL + 1])
    assert one.names() == {("mlp", 1)}
