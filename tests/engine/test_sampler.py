"""SamplingParams validation and the sampler's math on hand-made logits (llama.cpp's semantics)."""

import dataclasses
import math
from collections import Counter

import pytest
import torch

from bubo.engine.sampler import Sampler, SamplingParams, apply_penalties, min_p_mask, top_p_mask

# Every filter off: the draw must follow softmax(logits / T) exactly.
PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> Counter[int]:
    sampler = Sampler(params, vocab_size=logits.numel())
    return Counter(int(sampler.sample(logits)) for _ in range(n))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def test_defaults_are_llama_servers() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert p.seed is None and p.max_tokens is None and p.logit_bias == {} and p.stop == []
    assert p.ignore_eos is False
    p.validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.7"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", math.nan),
        ("repeat_last_n", -2),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -math.inf),
        ("seed", -2),
        ("seed", 2**64),
        ("seed", 1.0),
        ("max_tokens", -2),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: math.nan}),
        ("logit_bias", {3: math.inf}),
        ("logit_bias", [(3, 1.0)]),
        ("stop", "STOP"),
        ("stop", [""]),
        ("stop", [3]),
        ("ignore_eos", 1),
    ],
)
def test_validate_names_the_bad_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.0},
        {"temperature": -1.0},  # llama.cpp: any temperature <= 0 is greedy
        {"seed": -1},
        {"seed": 0},
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"repeat_last_n": -1},
        {"top_p": 1.0, "min_p": 0.0, "top_k": 0},
        {"logit_bias": {5: -math.inf, 6: 2}},
        {"stop": ["a", "bc"]},
    ],
)
def test_validate_accepts_edge_values(changes: dict[str, object]) -> None:
    SamplingParams(**changes).validate()


def test_greedy_is_argmax_and_deterministic() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    for seed in (None, 1, 2):
        sampler = Sampler(SamplingParams(temperature=0.0, seed=seed), vocab_size=4)
        assert {int(sampler.sample(logits)) for _ in range(20)} == {1}


def test_sample_returns_a_device_tensor() -> None:
    token = Sampler(SamplingParams(seed=3), vocab_size=4).sample(torch.tensor([0.1, 2.0, 1.9, -3.0]))
    assert token.dtype == torch.long and token.dim() == 0 and token.device.type == "cpu"


def test_penalty_values() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    counts = torch.tensor([2.0, 1.0, 0.0, 0.0, 1.0])
    out = apply_penalties(logits, counts, repeat=2.0, frequency=0.5, presence=0.25)
    # seen tokens: positive logit divided, non-positive multiplied, then - count*freq - presence
    expected = [2.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0, 0.0 - 0.5 - 0.25]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)


def test_penalty_window_is_the_last_repeat_last_n_tokens() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=3, presence_penalty=0.125)
    sampler = Sampler(params, vocab_size=4, history=[0, 0, 1, 2])  # window: [0, 1, 2]
    torch.testing.assert_close(sampler.process(logits), torch.tensor([0.375, 0.375, 0.375, 1.0]))
    sampler.accept(3)  # window: [1, 2, 3]
    sampler.accept(3)  # window: [2, 3, 3]
    torch.testing.assert_close(sampler.process(logits), torch.tensor([1.0, 1.0, 0.375, 0.375]))


def test_repeat_last_n_zero_disables_and_minus_one_means_everything() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0])
    history = [0] * 100 + [1]
    off = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0), vocab_size=3, history=history)
    torch.testing.assert_close(off.process(logits), logits)
    everything = Sampler(
        SamplingParams(repeat_penalty=2.0, repeat_last_n=-1, frequency_penalty=0.01),
        vocab_size=3,
        history=history,
    )
    torch.testing.assert_close(everything.process(logits), torch.tensor([0.5 - 1.0, 0.5 - 0.01, 1.0]))


def test_logit_bias_comes_before_penalties_as_in_llama_cpp() -> None:
    params = SamplingParams(temperature=0.0, repeat_penalty=2.0, logit_bias={0: 1.0})
    sampler = Sampler(params, vocab_size=2, history=[0])
    # (1 + 1) / 2, not 1 / 2 + 1
    torch.testing.assert_close(sampler.process(torch.tensor([1.0, 0.0])), torch.tensor([1.0, 0.0]))


def test_logit_bias_changes_the_greedy_choice() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5])
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias={2: 0.75}), vocab_size=3)
    assert int(sampler.sample(logits)) == 2


def test_logit_bias_outside_the_vocabulary_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={7: 1.0}), vocab_size=4)


def test_banned_token_is_never_sampled() -> None:
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, 4.5])
    params = SamplingParams(temperature=2.0, logit_bias={0: -math.inf}, seed=11, **PLAIN)
    counts = draw(params, logits, 3000)
    assert 0 not in counts and set(counts) == {1, 2, 3, 4}
    # ignore_eos passes stop tokens as `banned`, which is the same -inf bias
    sampler = Sampler(SamplingParams(temperature=2.0, seed=11, **PLAIN), vocab_size=5, banned=[0, 4])
    assert {int(sampler.sample(logits)) for _ in range(1000)} <= {1, 2, 3}


@pytest.mark.parametrize(
    ("p", "kept"),
    [(0.3, 1), (0.6, 2), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)],
)
def test_top_p_keeps_the_minimal_nucleus(p: float, kept: int) -> None:
    sorted_logits = log_probs(0.5, 0.3, 0.15, 0.05)
    mask = top_p_mask(sorted_logits, p)
    assert mask.tolist() == [False] * kept + [True] * (4 - kept)


def test_top_p_sampling_renormalizes_the_nucleus() -> None:
    logits = log_probs(0.05, 0.5, 0.15, 0.3)  # unsorted on purpose
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0, seed=5)
    counts = draw(params, logits, 4000)
    assert set(counts) == {1, 3}
    assert counts[1] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)


@pytest.mark.parametrize(("p", "kept"), [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_is_relative_to_the_top_probability(p: float, kept: set[int]) -> None:
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    mask = min_p_mask(logits, p)
    assert {i for i in range(4) if not mask[i]} == kept
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=p, seed=2)
    assert set(draw(params, logits, 800)) == kept


def test_top_k_keeps_the_k_best() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, 2.8, -1.0])
    params = SamplingParams(temperature=5.0, top_k=3, top_p=1.0, min_p=0.0, seed=9)
    assert set(draw(params, logits, 1000)) == {1, 3, 4}


def test_a_temperature_past_float32_draws_the_survivors_evenly() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, 2.8, -1.0])
    # min-p leaves -inf where it filters: -inf / inf would be NaN.
    params = SamplingParams(temperature=1e308, top_k=0, top_p=1.0, min_p=0.5, seed=9)
    sampler = Sampler(params, vocab_size=6)
    assert torch.equal(sampler.probabilities(logits), torch.tensor([0.0, 1, 0, 1, 1, 0]) / 3)
    assert set(draw(params, logits, 300)) == {1, 3, 4}


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # Over the whole vocabulary top_p=0.5 would keep tokens 0 and 1 (0.4 < 0.5); after top_k=2 the
    # survivors renormalize to 4/7 and 3/7, so the nucleus is token 0 alone, as in llama.cpp's chain.
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, min_p=0.0, seed=4)
    assert set(draw(params, logits, 500)) == {0}


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([1.3, -0.2, 0.4, 2.0, 0.0, -1.5])
    temperature, n = 0.7, 20_000
    counts = draw(SamplingParams(temperature=temperature, seed=1234, **PLAIN), logits, n)
    expected = (logits / temperature).softmax(-1) * n
    chi2 = sum((counts[i] - float(expected[i])) ** 2 / float(expected[i]) for i in range(6))
    # 5 degrees of freedom: chi2 > 20.5 has probability 0.001 under the right distribution; the
    # seed is fixed, so this is deterministic, and a wrong distribution (e.g. T ignored) gives > 1000.
    assert chi2 < 20.5
    wrong = logits.softmax(-1) * n
    assert sum((counts[i] - float(wrong[i])) ** 2 / float(wrong[i]) for i in range(6)) > 200


def test_same_seed_same_tokens_and_drawn_seeds_reproduce() -> None:
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, seed=42, **PLAIN)

    def run(p: SamplingParams) -> list[int]:
        sampler = Sampler(p, vocab_size=50)
        return [int(sampler.sample(logits)) for _ in range(40)]

    assert run(params) == run(params)
    assert run(params) != run(dataclasses.replace(params, seed=43))
    drawn = Sampler(dataclasses.replace(params, seed=None), vocab_size=50)
    tokens = [int(drawn.sample(logits)) for _ in range(40)]
    assert run(dataclasses.replace(params, seed=drawn.seed)) == tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_stays_on_the_cuda_device() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)).cuda()
    params = SamplingParams(
        temperature=1.0, seed=3, repeat_penalty=1.3, logit_bias={int(logits.argmax()): -math.inf}
    )

    def run() -> list[int]:
        sampler = Sampler(params, vocab_size=1000, device="cuda", history=[1, 2, 3])
        tokens = [sampler.sample(logits) for _ in range(50)]
        assert all(t.device.type == "cuda" for t in tokens)
        return [int(t) for t in tokens]

    first = run()
    assert first == run() and int(logits.argmax()) not in first
