"""Speculative decoding (bubo/engine/speculative.py) on tiny Qwen3.5 models with an MTP block: a
dense-attention one and a hybrid one with Gated DeltaNet layers; and on a tiny qwen4exp with its MTP
block (QSA indexer and PLE states).

The reference for every output is plain decoding (no drafter) of the same model; the reference for
the acceptance step is the target distribution p itself (speculative sampling must leave it unchanged).
Besides the MTP drafter (random weights: its drafts are almost always rejected), test drafters force
each path: one that proposes exactly what plain decoding will pick (every draft accepted), one that
always proposes a wrong token (every draft rejected) and one right only on its first token (partial).
"""

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch

from bubo.engine.drafters import drafter_for
from bubo.engine.generate import GenerationResult, TextDelta, generate
from bubo.engine.sampler import SamplingParams
from bubo.engine.speculative import DEFAULT_SPEC_DRAFT, Draft, DrawDraft, MTPDrafter, accept_or_resample
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.state import KVCache
from tests.fixtures.mtp_models import mtp_model
from tests.fixtures.qwen4exp_mtp import qwen4exp_mtp_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 300
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = [[1, 2, 3, 4, 5], [250, 7], [42] * 9 + [17, 99]]
KINDS = {"dense": ["full_attention"] * 2, "hybrid": ["linear_attention", "full_attention"] * 2}


class ByteTokenizer:
    """Token i is the byte i % 256 (text is not what these tests check); no stop tokens unless given."""

    def __init__(self, stop_ids: frozenset[int] = frozenset()) -> None:
        self.stop_ids = stop_ids

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id % 256])

    def is_special(self, token_id: int) -> bool:
        return False


@pytest.fixture(scope="module", params=list(KINDS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    _, path = mtp_model("qwen35", KINDS[request.param], tmp_path_factory.mktemp("mtp") / "model.gguf")
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def run(
    model: Decoder, prompt: list[int], params: SamplingParams = GREEDY, **kwargs: object
) -> tuple[list[TextDelta], GenerationResult, KVCache]:
    cache = model.new_cache(max_len=64)
    events = list(generate(model, ByteTokenizer(), prompt, params, cache=cache, **kwargs))
    result = events[-1]
    assert isinstance(result, GenerationResult)
    return events[:-1], result, cache


class ScriptedDrafter:
    """Proposes from a known continuation of the prompt: `pick(position, expected)` says what to propose
    for the token at `position` whose plain-decoding value is `expected`."""

    needs_hidden = True  # reads the hidden states' row count

    def __init__(self, expected: Sequence[int], pick: Callable[[int, int, int], int], max_draft: int) -> None:
        self.expected, self.pick, self.max_draft = list(expected), pick, max_draft
        self.calls: list[tuple[int, int, int]] = []  # (context length, hidden rows, n) per round

    def start(self, max_len: int) -> None:
        self.calls = []

    def propose(self, context: Sequence[int], hidden: torch.Tensor, n: int, draw_draft: DrawDraft) -> Draft:
        self.calls.append((len(context), hidden.shape[1], n))
        start = len(context)
        return Draft([self.pick(i, start + i, self._at(start + i)) for i in range(n)])

    def _at(self, position: int) -> int:
        return self.expected[position] if position < len(self.expected) else 0


def oracle(expected: Sequence[int], n: int) -> ScriptedDrafter:
    return ScriptedDrafter(expected, lambda i, position, right: right, n)


def wrong(expected: Sequence[int], n: int) -> ScriptedDrafter:
    return ScriptedDrafter(expected, lambda i, position, right: (right + 1) % VOCAB, n)


def first_right(expected: Sequence[int], n: int) -> ScriptedDrafter:
    return ScriptedDrafter(expected, lambda i, position, right: right if i == 0 else (right + 1) % VOCAB, n)


def assert_same_cache(a: KVCache, b: KVCache) -> None:
    """Same length, keys, values and DeltaNet states (up to float rounding: the verify pass runs
    several positions through the same matmuls)."""
    assert a.length == b.length and a.num_layers == b.num_layers
    for layer in range(a.num_layers):
        for x, y in zip(a.read(layer), b.read(layer), strict=True):
            assert torch.allclose(x, y, atol=1e-4)
    for s, t in zip(a.recurrent, b.recurrent, strict=True):
        assert torch.allclose(s.conv_state, t.conv_state, atol=1e-4)
        assert torch.allclose(s.recurrent_state, t.recurrent_state, atol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_output_is_identical_with_the_mtp_drafter(model: Decoder, n: int) -> None:
    for prompt in PROMPTS:
        deltas, plain, plain_cache = run(model, prompt)
        spec_deltas, spec, spec_cache = run(model, prompt, drafter=MTPDrafter(model, n))
        assert spec.token_ids == plain.token_ids and len(plain.token_ids) == GREEDY.max_tokens
        assert [d.token_ids for d in spec_deltas] == [d.token_ids for d in deltas]
        assert spec.draft_tokens > 0 and 0 <= spec.draft_accepted <= spec.draft_tokens
        assert_same_cache(spec_cache, plain_cache)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("drafter", [oracle, wrong, first_right])
def test_forced_drafts_exercise_accept_and_reject(model: Decoder, n: int, drafter: Callable) -> None:
    prompt = PROMPTS[0]
    _, plain, plain_cache = run(model, prompt)
    expected = prompt + plain.token_ids
    scripted = drafter(expected, n)
    _, spec, spec_cache = run(model, prompt, drafter=scripted)
    assert spec.token_ids == plain.token_ids
    assert_same_cache(spec_cache, plain_cache)
    assert spec_cache.length == len(prompt) + len(plain.token_ids) - 1

    # A round of k drafts yields the accepted ones and one token of the model's own; the drafter then
    # sees the hidden states of exactly the positions the model ran and kept.
    accepted_of = {oracle: lambda k: k, wrong: lambda k: 0, first_right: lambda k: min(k, 1)}[drafter]
    assert scripted.calls[0][:2] == (len(prompt) + 1, len(prompt))
    for (length, _, k), (next_length, rows, _) in zip(scripted.calls, scripted.calls[1:], strict=False):
        assert next_length - length == rows == accepted_of(k) + 1
    assert spec.draft_tokens == sum(k for _, _, k in scripted.calls)
    assert spec.draft_accepted == sum(accepted_of(k) for _, _, k in scripted.calls)
    assert max(k for *_, k in scripted.calls) == n


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 8])
def test_max_tokens_inside_a_round_keeps_the_cache_exact(model: Decoder, max_tokens: int) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
    _, plain, plain_cache = run(model, PROMPTS[0], params)
    _, spec, spec_cache = run(model, PROMPTS[0], params, drafter=oracle(PROMPTS[0] + plain.token_ids, 3))
    assert spec.token_ids == plain.token_ids and spec.stop_reason == "max_tokens"
    assert_same_cache(spec_cache, plain_cache)
    # no drafts past the limit
    assert spec.draft_tokens == spec.draft_accepted <= max_tokens - 1


def test_a_stop_token_inside_an_accepted_run_rolls_back_to_it(model: Decoder) -> None:
    _, plain, _ = run(model, PROMPTS[0])
    stop = plain.token_ids[6]
    first = plain.token_ids.index(stop)
    tokenizer = ByteTokenizer(frozenset({stop}))
    results = []
    for drafter in (None, oracle(PROMPTS[0] + plain.token_ids, 3)):
        cache = model.new_cache(max_len=64)
        events = list(generate(model, tokenizer, PROMPTS[0], GREEDY, cache=cache, drafter=drafter))
        results.append((events[-1], cache))
    (a, a_cache), (b, b_cache) = results
    assert isinstance(a, GenerationResult) and isinstance(b, GenerationResult)
    assert a.token_ids == b.token_ids == plain.token_ids[: first + 1] and b.stop_reason == "eos"
    assert_same_cache(b_cache, a_cache)


def test_the_context_end_stops_speculation_exactly(model: Decoder) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=None)
    results = []
    for drafter in (None, MTPDrafter(model, 3)):
        cache = model.new_cache(max_len=16)
        events = list(generate(model, ByteTokenizer(), PROMPTS[0], params, cache=cache, drafter=drafter))
        results.append((events[-1], cache))
    (a, a_cache), (b, b_cache) = results
    assert isinstance(a, GenerationResult) and isinstance(b, GenerationResult)
    assert b.token_ids == a.token_ids and b.stop_reason == a.stop_reason == "context"
    assert_same_cache(b_cache, a_cache)


def test_penalties_and_logprobs_are_unchanged(model: Decoder) -> None:
    params = dataclasses.replace(GREEDY, repeat_penalty=1.3, presence_penalty=0.5)
    deltas, plain, _ = run(model, PROMPTS[2], params, logprobs=2)
    spec_deltas, spec, _ = run(
        model, PROMPTS[2], params, logprobs=2, drafter=oracle(PROMPTS[2] + plain.token_ids, 2)
    )
    assert spec.token_ids == plain.token_ids and spec.draft_accepted == spec.draft_tokens > 0
    for d, e in zip(deltas, spec_deltas, strict=True):
        for x, y in zip(d.logprobs, e.logprobs, strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


class EveryOtherTokenEven:
    """A stateful constraint: tokens at even steps must be even; records what it was told."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if len(self.seen) % 2:
            return logits
        return logits.masked_fill(torch.arange(logits.numel()) % 2 == 1, float("-inf"))

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)


def test_constraints_see_only_the_chosen_tokens(model: Decoder) -> None:
    unconstrained = run(model, PROMPTS[1])[1].token_ids
    plain_constraint, spec_constraint = EveryOtherTokenEven(), EveryOtherTokenEven()
    _, plain, _ = run(model, PROMPTS[1], constraints=[plain_constraint])
    # drafts of the unconstrained continuation: the constraint rejects the odd ones at even steps
    _, spec, _ = run(
        model, PROMPTS[1], constraints=[spec_constraint], drafter=oracle(PROMPTS[1] + unconstrained, 2)
    )
    assert spec.token_ids == plain.token_ids != unconstrained
    assert spec_constraint.seen == plain_constraint.seen == plain.token_ids
    assert all(t % 2 == 0 for t in plain.token_ids[::2])


@pytest.mark.parametrize("kind", ["oracle", "mtp"])
def test_sampling_with_a_drafter_counts_and_rolls_back(model: Decoder, kind: str) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, seed=5, max_tokens=20)
    _, plain, _ = run(model, PROMPTS[0], dataclasses.replace(params, temperature=0.0))
    drafter = oracle(PROMPTS[0] + plain.token_ids, 2) if kind == "oracle" else MTPDrafter(model, 2)
    _, spec, cache = run(model, PROMPTS[0], params, drafter=drafter)
    assert len(spec.token_ids) == 20 and spec.draft_tokens > 0
    assert 0 <= spec.draft_accepted <= spec.draft_tokens
    assert cache.length == len(PROMPTS[0]) + 19
    # the same seed, the same draws
    assert run(model, PROMPTS[0], params, drafter=drafter)[1].token_ids == spec.token_ids


@pytest.mark.parametrize(
    ("p", "q"),
    [
        ([0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]),  # q's favourite is impossible under p
        ([0.25, 0.25, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]),  # q = p: always accepted
        ([0.05, 0.05, 0.8, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]),  # a deterministic, always wrong draft
    ],
)
def test_rejection_sampling_leaves_the_target_distribution_unchanged(p: list[float], q: list[float]) -> None:
    target, draft = torch.tensor(p), torch.tensor(q)
    generator = torch.Generator().manual_seed(11)
    draws = 40_000
    counts = torch.zeros(len(p))
    kept = 0
    for token in torch.multinomial(draft, draws, replacement=True, generator=generator).tolist():
        chosen, accepted = accept_or_resample(target, draft, token, generator)
        counts[chosen] += 1
        kept += accepted
    empirical = counts / draws
    # 5 standard errors of a proportion at worst (p = 0.5): 0.0125
    assert (empirical - target).abs().max() <= 5 * (0.25 / draws) ** 0.5
    # the acceptance rate is sum(min(p, q)) (Leviathan et al., Theorem 3.5)
    assert abs(kept / draws - float(torch.minimum(target, draft).sum())) <= 0.0125


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """The tiny qwen4exp of the model tests with its MTP block: QSA indexer and PLE states, which have no
    copies inside a pass (a rejected draft restores the states from before the pass and reruns the kept
    tokens), and a block whose own QSA indexer state is restored, not cut, after chained drafts."""
    _, path = qwen4exp_mtp_model(tmp_path_factory.mktemp("q4exp") / "tiny-qwen4exp.gguf")
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def assert_same_qwen4exp_cache(a: KVCache, b: KVCache) -> None:
    assert_same_cache(a, b)
    for s, t in zip(a.indexers, b.indexers, strict=True):
        assert (s.num_blocks, s.tail_len) == (t.num_blocks, t.tail_len)
        assert torch.allclose(s.block_keys[:, : s.num_blocks], t.block_keys[:, : t.num_blocks], atol=1e-4)
        assert torch.allclose(s.tail_keys[:, : s.tail_len], t.tail_keys[:, : t.tail_len], atol=1e-4)
    assert a.ple is not None and b.ple is not None
    assert torch.equal(a.ple.tokens, b.ple.tokens)
    assert torch.allclose(a.ple.conv_state, b.ple.conv_state, atol=1e-4)


class RecordingMTPDrafter(MTPDrafter):
    """The MTP drafter, keeping each round's context and drafts."""

    def __init__(self, model: Decoder, max_draft: int) -> None:
        super().__init__(model, max_draft)
        self.rounds: list[tuple[list[int], list[int]]] = []

    def propose(self, context: Sequence[int], hidden: torch.Tensor, n: int, draw_draft: DrawDraft) -> Draft:
        draft = super().propose(context, hidden, n, draw_draft)
        self.rounds.append((list(context), draft.tokens))
        return draft


def test_qwen4exp_drafts_with_its_mtp_block_by_default(qwen4exp: Decoder) -> None:
    drafter = drafter_for(qwen4exp, None, None)
    assert isinstance(drafter, MTPDrafter) and drafter.max_draft == DEFAULT_SPEC_DRAFT


@pytest.mark.parametrize("n", [1, 3])
def test_qwen4exp_greedy_output_is_identical_with_its_mtp_block(qwen4exp: Decoder, n: int) -> None:
    _, plain, plain_cache = run(qwen4exp, PROMPTS[0])
    _, spec, spec_cache = run(qwen4exp, PROMPTS[0], drafter=MTPDrafter(qwen4exp, n))
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == GREEDY.max_tokens
    assert spec.draft_tokens > 0 and 0 <= spec.draft_accepted <= spec.draft_tokens
    assert_same_qwen4exp_cache(spec_cache, plain_cache)


def test_qwen4exp_mtp_drafts_are_the_blocks_forward_over_the_whole_context(qwen4exp: Decoder) -> None:
    """Each round's drafts equal the block run afresh over the sequence so far: the drafter's MTP cache
    (keys, values and QSA indexer state) holds exactly the settled rows after chained drafts."""
    drafter = RecordingMTPDrafter(qwen4exp, 2)
    run(qwen4exp, PROMPTS[2], drafter=drafter)
    assert sum(len(drafted) == 2 for _, drafted in drafter.rounds) > 5
    with torch.inference_mode():
        for context, drafted in drafter.rounds:
            tokens = torch.tensor([context])
            _, streams = qwen4exp.hidden_and_mtp_input(tokens[:, :-1], qwen4exp.new_cache(max_len=64))
            cache = qwen4exp.new_mtp_cache(max_len=64)
            head_input, chained = qwen4exp.draft_hidden(streams, tokens[:, 1:], cache)
            expected: list[int] = []
            while len(expected) < len(drafted):
                if expected:
                    last = torch.tensor([expected[-1:]])
                    head_input, chained = qwen4exp.draft_hidden(chained[:, -1:], last, cache)
                expected.append(int(qwen4exp.draft_head(head_input[:, -1:]).argmax()))
            assert drafted == expected


def test_qwen4exp_sampling_with_its_mtp_block_counts_and_rolls_back(qwen4exp: Decoder) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.0, seed=5, max_tokens=20)
    _, spec, cache = run(qwen4exp, PROMPTS[0], params, drafter=MTPDrafter(qwen4exp, 2))
    assert len(spec.token_ids) == 20 and spec.draft_tokens > 0
    assert 0 <= spec.draft_accepted <= spec.draft_tokens
    assert cache.length == len(PROMPTS[0]) + 19
    assert run(qwen4exp, PROMPTS[0], params, drafter=MTPDrafter(qwen4exp, 2))[1].token_ids == spec.token_ids


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("drafter", [oracle, wrong, first_right])
def test_qwen4exp_rolls_back_its_indexer_and_ple_states(qwen4exp: Decoder, n: int, drafter: Callable) -> None:
    prompt = PROMPTS[2]
    _, plain, plain_cache = run(qwen4exp, prompt)
    scripted = drafter(prompt + plain.token_ids, n)
    _, spec, spec_cache = run(qwen4exp, prompt, drafter=scripted)
    assert spec.token_ids == plain.token_ids and spec.draft_tokens > 0
    if drafter is oracle:
        assert spec.draft_accepted == spec.draft_tokens
    elif drafter is wrong:
        assert spec.draft_accepted == 0
    assert_same_qwen4exp_cache(spec_cache, plain_cache)
