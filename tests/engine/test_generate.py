"""The generation loop on a scripted fake model and a byte-level fake tokenizer, then on the real default model."""

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from bubo.engine import generate as generate_module
from bubo.engine.generate import GenerationResult, TextDelta, generate
from bubo.engine.loaded_model import load_model
from bubo.engine.sampler import SamplingParams

# ids 0-255: single bytes; then whole words and special tokens.
EXTRA = {256: b"Hello", 257: b" world", 258: b"<|im_end|>", 259: b"<|im_start|>"}
EOS, IM_START = 258, 259
VOCAB = 260
GREEDY = SamplingParams(temperature=0.0)


class FakeTokenizer:
    stop_ids = frozenset({EOS})

    def token_bytes(self, token_id: int) -> bytes:
        return EXTRA.get(token_id, bytes([token_id]) if token_id < 256 else b"")

    def is_special(self, token_id: int) -> bool:
        return token_id in (EOS, IM_START)


def text_ids(text: str) -> list[int]:
    return list(text.encode())


@dataclass
class FakeCache:
    max_len: int
    tokens: list[int] = field(default_factory=list)
    can_rewind: bool = True  # False acts like a hybrid model's recurrent state

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        assert self.can_rewind or n in (0, self.length), "a recurrent state can't be rewound"
        del self.tokens[n:]

    def reserve(self, n: int) -> bool:
        return self.length + n <= self.max_len


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    context_length: int = 64


class ScriptedModel(nn.Module):
    """After the prompt, the top logit follows `script` (then repeats `filler`); `runner_up` is second best."""

    def __init__(self, script: list[int], context_length: int = 64, filler: int = ord("x")) -> None:
        super().__init__()
        self.config = FakeConfig(context_length=context_length)
        self.script, self.filler, self.runner_up = script, filler, ord("y")
        self.calls: list[list[int]] = []
        self.prompt_len: int | None = None
        self.device = torch.device("cpu")

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> FakeCache:
        return FakeCache(max_len=max_len or self.config.context_length)

    def forward(self, tokens: torch.Tensor, cache: FakeCache, last_only: bool = False) -> torch.Tensor:
        assert torch.is_inference_mode_enabled()
        assert tokens.shape[0] == 1 and tokens.dtype == torch.long
        assert cache.length + tokens.shape[1] <= cache.max_len, "forward past the cache's end"
        if self.prompt_len is None:
            self.prompt_len = tokens.shape[1]
        self.calls.append(tokens[0].tolist())
        rows = []
        for token in tokens[0].tolist():
            cache.tokens.append(token)
            step = cache.length - self.prompt_len
            row = torch.zeros(VOCAB)
            row[self.runner_up] = 5.0
            row[self.script[step] if 0 <= step < len(self.script) else self.filler] = 10.0
            rows.append(row)
        return torch.stack(rows[-1:] if last_only else rows)[None]


def run(
    model: nn.Module, prompt: list[int], params: SamplingParams, tokenizer: object = None, **kwargs: object
) -> tuple[list[TextDelta], GenerationResult]:
    events = list(generate(model, tokenizer or FakeTokenizer(), prompt, params, **kwargs))
    assert all(isinstance(e, TextDelta) for e in events[:-1])
    assert isinstance(events[-1], GenerationResult)
    return events[:-1], events[-1]


def test_greedy_follows_the_model_and_stops_at_eos() -> None:
    model = ScriptedModel([256, 257, ord("!"), EOS])
    deltas, result = run(model, text_ids("Hi"), GREEDY)
    assert [d.text for d in deltas] == ["Hello", " world", "!"]
    assert [d.token_ids for d in deltas] == [[256], [257], [ord("!")]]
    assert result.text == "Hello world!"
    assert (result.finish_reason, result.stop_reason, result.stop_token_id) == ("stop", "eos", EOS)
    assert result.token_ids == [256, 257, ord("!"), EOS]
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (2, 4, 0)
    # the prompt in one forward, then one token per forward; the EOS is never fed back
    assert model.calls == [text_ids("Hi"), [256], [257], [ord("!")]]


def test_max_tokens_ends_with_length() -> None:
    model = ScriptedModel([])
    _, result = run(model, [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=5))
    assert result.text == "xxxxx" and result.completion_tokens == 5
    assert (result.finish_reason, result.stop_reason) == ("length", "max_tokens")
    assert len(model.calls) == 5  # the 5th token is not fed back


def test_max_tokens_zero_only_prefills() -> None:
    model = ScriptedModel([])
    deltas, result = run(model, [1, 2], dataclasses.replace(GREEDY, max_tokens=0))
    assert deltas == [] and result.token_ids == [] and result.finish_reason == "length"
    assert model.calls == [[1, 2]]


@pytest.mark.parametrize("max_tokens", [None, -1])
@pytest.mark.parametrize("given_cache", [False, True])
def test_context_end_ends_with_length(max_tokens: int | None, given_cache: bool) -> None:
    model = ScriptedModel([], context_length=8)
    cache = model.new_cache()
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
    _, result = run(model, [1, 2, 3, 4, 5], params, cache=cache if given_cache else None)
    # Prompt and completion count the context's 8 tokens, as llama-server counts them, not one more: the
    # 3rd token is not fed, since the token it would predict has no position left.
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)
    assert (result.finish_reason, result.stop_reason) == ("length", "context")
    assert model.calls[-1] == [ord("x")] and len(model.calls) == 3


def test_cache_is_sized_to_prompt_plus_max_tokens() -> None:
    model = ScriptedModel([], context_length=1000)
    seen: list[int] = []
    original = model.new_cache

    def spy(batch: int = 1, max_len: int | None = None) -> FakeCache:
        seen.append(max_len)
        return original(batch, max_len)

    model.new_cache = spy  # type: ignore[method-assign]
    run(model, [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=4))
    run(model, [1, 2, 3], GREEDY)
    assert seen == [7, 1000]


def test_emoji_across_four_tokens_comes_out_whole() -> None:
    owl = list("🦉".encode())
    model = ScriptedModel([ord("a"), *owl, *"猫".encode(), EOS])
    deltas, result = run(model, [1], GREEDY)
    assert [d.text for d in deltas] == ["a", "🦉", "猫"]
    assert [d.token_ids for d in deltas] == [[ord("a")], owl, list("猫".encode())]
    assert result.text == "a🦉猫"


def test_dangling_bytes_at_the_end_become_replacement() -> None:
    model = ScriptedModel([ord("a"), *"🦉".encode()[:2]])
    deltas, result = run(model, [1], dataclasses.replace(GREEDY, max_tokens=3))
    assert [d.text for d in deltas] == ["a", "\ufffd"] and result.text == "a\ufffd"
    assert deltas[-1].token_ids == list("🦉".encode()[:2])


def test_stop_string_across_tokens_ends_generation_without_its_text() -> None:
    model = ScriptedModel([256, *text_ids(" ST"), *text_ids("OP and more")])
    deltas, result = run(model, [1], dataclasses.replace(GREEDY, stop=["STOP"]))
    assert "".join(d.text for d in deltas) == "Hello " == result.text
    assert (result.finish_reason, result.stop_reason, result.stop_string) == ("stop", "stop_string", "STOP")
    # Hello, space, S, T, O, P: generation halts at the P, which is never fed back
    assert result.token_ids == [256, *text_ids(" STOP")]
    assert model.calls == [[1], [256], *([t] for t in text_ids(" STO"))]


def test_held_stop_prefix_is_released_at_the_end() -> None:
    model = ScriptedModel(text_ids("ab ST"))
    deltas, result = run(model, [1], dataclasses.replace(GREEDY, max_tokens=5, stop=["STOP"]))
    assert result.text == "ab ST" and result.stop_string is None
    assert "".join(d.text for d in deltas) == "ab ST"


def test_ignore_eos_bans_the_stop_tokens() -> None:
    model = ScriptedModel([ord("a"), EOS, ord("b")])
    _, result = run(model, [1], dataclasses.replace(GREEDY, max_tokens=4, ignore_eos=True))
    assert result.token_ids == [ord("a"), ord("y"), ord("b"), ord("x")]  # the runner-up replaces EOS
    assert result.stop_reason == "max_tokens"


def test_special_tokens_have_no_text_unless_asked() -> None:
    model = ScriptedModel([IM_START, ord("a"), EOS])
    assert run(model, [1], GREEDY)[1].text == "a"
    model = ScriptedModel([IM_START, ord("a"), EOS])
    assert run(model, [1], GREEDY, special=True)[1].text == "<|im_start|>a"


def test_penalties_see_the_prompt() -> None:
    model = ScriptedModel([ord("x")] * 3)
    _, result = run(model, text_ids("xx"), dataclasses.replace(GREEDY, max_tokens=1, frequency_penalty=3.0))
    assert result.token_ids == [ord("y")]  # 10 - 2*3 < 5


def test_logit_bias_ban_and_range() -> None:
    model = ScriptedModel([ord("a")])
    _, result = run(model, [1], dataclasses.replace(GREEDY, max_tokens=1, logit_bias={ord("a"): -math.inf}))
    assert result.token_ids == [ord("y")]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(ScriptedModel([]), [1], dataclasses.replace(GREEDY, logit_bias={VOCAB: 1.0}))


def test_bad_prompts_and_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        run(ScriptedModel([]), [], GREEDY)
    with pytest.raises(ValueError, match=r"9 tokens .* context is 8"):
        run(ScriptedModel([], context_length=8), list(range(9)), GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        run(ScriptedModel([]), [1], SamplingParams(top_p=0.0))


def test_same_seed_same_text() -> None:
    class Flat(ScriptedModel):
        def forward(self, tokens: torch.Tensor, cache: FakeCache, last_only: bool = False) -> torch.Tensor:
            return torch.zeros_like(super().forward(tokens, cache, last_only))

    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=30, ignore_eos=True)
    first = run(Flat([]), [1], dataclasses.replace(params, seed=7))[1]
    again = run(Flat([]), [1], dataclasses.replace(params, seed=7))[1]
    other = run(Flat([]), [1], dataclasses.replace(params, seed=8))[1]
    drawn = run(Flat([]), [1], params)[1]
    assert first.token_ids == again.token_ids != other.token_ids
    assert first.seed == 7
    assert run(Flat([]), [1], dataclasses.replace(params, seed=drawn.seed))[1].token_ids == drawn.token_ids


def test_a_cache_holding_the_prompt_prefix_is_reused() -> None:
    model = ScriptedModel([ord("a"), EOS])
    model.prompt_len = 4
    cache = FakeCache(max_len=16, tokens=[1, 2, 3])
    _, result = run(model, [1, 2, 3, 4], GREEDY, cache=cache)
    assert model.calls == [[4], [ord("a")]] and result.cached_tokens == 3 and result.prompt_tokens == 4
    assert result.timings.prefill_tokens == 1

    # the whole prompt cached: the last token is computed again for its logits
    model = ScriptedModel([ord("a"), EOS])
    model.prompt_len = 4
    _, result = run(model, [1, 2, 3, 4], GREEDY, cache=FakeCache(max_len=16, tokens=[1, 2, 3, 4]))
    assert model.calls == [[4], [ord("a")]] and result.cached_tokens == 3
    with pytest.raises(ValueError, match="cache holds at most 2"):
        run(ScriptedModel([]), [1, 2, 3], GREEDY, cache=FakeCache(max_len=2))


def test_a_cache_that_cannot_rewind_is_reused_whole_or_recomputed() -> None:
    # a strict prefix of the prompt: kept whole, only the rest is fed
    model = ScriptedModel([ord("a"), EOS])
    model.prompt_len = 4
    cache = FakeCache(max_len=16, tokens=[1, 2, 3], can_rewind=False)
    _, result = run(model, [1, 2, 3, 4], GREEDY, cache=cache)
    assert model.calls == [[4], [ord("a")]] and result.cached_tokens == 3

    # the whole prompt cached: the last token's logits would need a rewind, so it starts over
    model = ScriptedModel([ord("a"), EOS])
    cache = FakeCache(max_len=16, tokens=[1, 2, 3, 4], can_rewind=False)
    _, result = run(model, [1, 2, 3, 4], GREEDY, cache=cache)
    assert model.calls == [[1, 2, 3, 4], [ord("a")]] and result.cached_tokens == 0
    assert result.timings.prefill_tokens == 4


def test_a_long_prompt_prefills_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK_TOKENS", 4)
    model = ScriptedModel([ord("a"), EOS])
    model.prompt_len = 10
    prompt = list(range(1, 11))
    _, result = run(model, prompt, GREEDY)
    assert model.calls == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10], [ord("a")]]
    assert result.text == "a" and result.timings.prefill_tokens == 10


def test_a_cancel_during_a_chunked_prefill_stops_it_between_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # A client that leaves while a long prompt is computed must not keep the slot for the rest of it.
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK_TOKENS", 4)
    model = ScriptedModel([ord("a"), EOS])
    model.prompt_len = 10
    cache = FakeCache(max_len=16)
    deltas, result = run(model, list(range(1, 11)), GREEDY, cache=cache, cancelled=lambda: bool(model.calls))
    assert model.calls == [[1, 2, 3, 4]]
    assert deltas == [] and result.token_ids == [] and result.stop_reason == "cancelled"
    assert cache.tokens == [1, 2, 3, 4]  # what ran stays, for the prompt cache to account for
    assert result.timings.prefill_tokens == 4


def test_a_request_cancelled_before_its_prefill_runs_nothing() -> None:
    model = ScriptedModel([ord("a"), EOS])
    deltas, result = run(model, [1, 2, 3], GREEDY, cancelled=lambda: True)
    assert model.calls == [] and deltas == []
    assert (result.stop_reason, result.completion_tokens) == ("cancelled", 0)


def test_timings_and_inference_mode_stay_inside_the_generator() -> None:
    model = ScriptedModel([256, 257, EOS])
    events: list[object] = []
    for event in generate(model, FakeTokenizer(), [1, 2, 3], GREEDY):
        # the decorator must not leak inference mode to the consumer between yields
        assert not torch.is_inference_mode_enabled()
        events.append(event)
    assert isinstance(events[-1], GenerationResult)
    t = events[-1].timings
    assert t.prefill_tokens == 3 and t.decode_tokens == 2
    assert t.prefill_seconds > 0 and t.decode_seconds >= 0
    assert t.prefill_tokens_per_second > 0


def test_closing_the_stream_stops_the_model() -> None:
    model = ScriptedModel([])
    events = generate(model, FakeTokenizer(), [1], GREEDY)
    assert next(events) == TextDelta("x", [ord("x")])
    events.close()
    assert len(model.calls) == 1


# The real default model (SmolLM2-135M-Instruct Q4_1), when the package and the model modules exist.


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Any, one_thread: None) -> Iterator[Any]:
    # One thread: these few small forwards gain nothing from more (see the one_thread fixture).
    loaded = load_model(smollm2_path)
    yield loaded
    loaded.file.close()


def test_real_model_greedy_capital_of_france(smollm2: Any) -> None:
    prompt = smollm2.tokenizer.encode("The capital of France is")
    deltas, result = run(smollm2.model, prompt, dataclasses.replace(GREEDY, max_tokens=3), smollm2.tokenizer)
    assert result.text.startswith(" Paris"), result.text
    assert "".join(d.text for d in deltas) == result.text
    assert result.prompt_tokens == len(prompt) and result.completion_tokens == len(result.token_ids) == 3


def test_real_model_same_seed_same_text(smollm2: Any) -> None:
    prompt = smollm2.tokenizer.encode("Once upon a time")
    # Few tokens: each forward of the real model costs a noticeable fraction of a second on CPU.
    params = SamplingParams(temperature=1.5, seed=1234, max_tokens=4)
    first = run(smollm2.model, prompt, params, smollm2.tokenizer)[1]
    again = run(smollm2.model, prompt, params, smollm2.tokenizer)[1]
    assert first.token_ids == again.token_ids and first.text == again.text and first.seed == 1234


def test_real_model_chunked_prefill_matches_one_pass(
    smollm2: Any, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    # The float matvecs: a ragged last chunk of a few rows runs matvecs, which with int8 activations would
    # differ from the one pass's GEMM by their rounding.
    runtime_options(int8_matvec=False)
    prompt = smollm2.tokenizer.encode(" and".join(["The capital of France is Paris"] * 6))
    params = dataclasses.replace(GREEDY, max_tokens=1)

    def first_logprob() -> tuple[int, float]:
        events = list(generate(smollm2.model, smollm2.tokenizer, prompt, params, logprobs=0))
        (logprob,) = [p for event in events if isinstance(event, TextDelta) for p in event.logprobs]
        return logprob.token_id, logprob.logprob

    whole = first_logprob()
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK_TOKENS", 16)
    assert len(prompt) > 2 * 16 + 1  # two whole chunks and a ragged one
    chunked = first_logprob()
    # The same float32 math over other row counts and an explicit causal mask: rounding alone differs.
    assert chunked[0] == whole[0] and abs(chunked[1] - whole[1]) <= 1e-4
