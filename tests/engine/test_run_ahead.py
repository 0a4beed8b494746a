"""Decoding with each step launched before the previous token is read back (bubo/engine/run_ahead.py),
as `generate` runs it with a CUDA-graph step: the same events as plain decoding whatever ends the
generation, the cache cut back to where plain decoding leaves it, and the step really queued ahead."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bubo.engine.generate import GenerationResult, TextDelta, generate
from bubo.engine.runner import Runner
from bubo.engine.sampler import SamplingParams
from bubo.model.decoder import Decoder
from bubo.model.state import KVCache
from tests.engine.test_graph_decode import PROMPT, _Bytes, _model

pytestmark = pytest.mark.usefixtures("one_thread")

Step = Callable[[torch.Tensor, KVCache], torch.Tensor]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    return _model("qwen2-bias", tmp_path_factory.mktemp("run_ahead") / "qwen2.gguf")


def _run(
    model: Decoder,
    params: SamplingParams,
    tokenizer: _Bytes,
    max_len: int = 40,
    cancel_after: int | None = None,
) -> tuple[list[str], GenerationResult, int]:
    """The text pieces, the result and the cache's final length of one generation."""
    cache = model.new_cache(max_len=max_len)
    asked: list[None] = []

    def cancelled() -> bool:  # asked once per token, before its successor is asked for
        asked.append(None)
        return cancel_after is not None and len(asked) >= cancel_after

    events = list(generate(model, tokenizer, PROMPT[0].tolist(), params, cache=cache, cancelled=cancelled))
    pieces = [e.text for e in events if isinstance(e, TextDelta)]
    result = events[-1]
    assert isinstance(result, GenerationResult)
    return pieces, result, cache.length


def _eager_step(model: Decoder, calls: list[int]) -> Step:
    def step(token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        calls.append(cache.length)
        return model(token.view(1, 1), cache)[0, -1]

    return step


def _both(
    model: Decoder,
    monkeypatch: pytest.MonkeyPatch,
    params: SamplingParams,
    tokenizer: _Bytes,
    max_len: int = 40,
    cancel_after: int | None = None,
) -> str:
    """Plain decoding (no graph step on the CPU) and run-ahead decoding agree on everything; returns
    why both stopped."""
    plain = _run(model, params, tokenizer, max_len, cancel_after)
    monkeypatch.setattr(Runner, "graph_step", lambda runner, c: _eager_step(runner.model, []))
    ahead = _run(model, params, tokenizer, max_len, cancel_after)
    assert ahead[1].token_ids == plain[1].token_ids
    assert ahead[1].stop_reason == plain[1].stop_reason
    assert ahead[0] == plain[0] and ahead[1].text == plain[1].text
    assert ahead[2] == plain[2]
    return plain[1].stop_reason


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_token_limit(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _both(model, monkeypatch, GREEDY, _Bytes()) == "max_tokens"


def test_sampled(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=10)
    assert _both(model, monkeypatch, params, _Bytes()) == "max_tokens"


def test_stop_token(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = _run(model, GREEDY, _Bytes())[1].token_ids
    tokenizer = _Bytes()
    tokenizer.stop_ids = frozenset({greedy[4]})
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert _both(model, monkeypatch, params, tokenizer) == "eos"


def test_stop_string(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _run(model, GREEDY, _Bytes())[1].text
    assert len(text) >= 5
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[text[3:5]])
    assert _both(model, monkeypatch, params, _Bytes()) == "stop_string"


def test_full_cache(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    assert _both(model, monkeypatch, params, _Bytes(), max_len=PROMPT.shape[1] + 4) == "context"


def test_cancelled(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _both(model, monkeypatch, GREEDY, _Bytes(), cancel_after=3) == "cancelled"


def test_a_cache_that_cannot_be_cut_back_does_not_run_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid model's recurrent state can't be rewound: each step waits for the consumer, as plain
    (a step run ahead could not be cut back off: `truncate` would raise when the generation ends)."""
    from tests.engine.test_graph_decode import _hybrid

    hybrid = _hybrid(tmp_path / "hybrid.gguf")
    assert _both(hybrid, monkeypatch, GREEDY, _Bytes()) == "max_tokens"


def test_the_next_step_is_queued_before_a_token_is_handed_out(
    model: Decoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(Runner, "graph_step", lambda runner, c: _eager_step(runner.model, calls))
    cache = model.new_cache(max_len=40)
    events = generate(model, _Bytes(), PROMPT[0].tolist(), GREEDY, cache=cache)
    seen = 0
    for event in events:
        if isinstance(event, TextDelta):
            seen += len(event.token_ids)
            # Token k came from step k - 1, and step k (which takes it) is already queued.
            assert len(calls) >= seen
    assert len(calls) == GREEDY.max_tokens  # one past the plain loop's, cut back off the cache
    assert cache.length == PROMPT.shape[1] + GREEDY.max_tokens - 1


def test_graph_step_in_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole CUDA path's logic on the CPU: the static step (capture injected) run ahead."""
    from bubo.engine.graph_decode import GraphDecodeStep, masked_attention

    model = _model("llama-tied", tmp_path / "llama.gguf")
    plain = _run(model, GREEDY, _Bytes())
    captures: list[Callable[[], torch.Tensor]] = []

    def capture(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        captures.append(run)
        return run

    step = GraphDecodeStep(model, masked_attention, capture=capture)
    monkeypatch.setattr(Runner, "graph_step", lambda runner, c: step)
    graphed = _run(model, GREEDY, _Bytes())
    assert graphed[1].token_ids == plain[1].token_ids and graphed[2] == plain[2]
    assert len(captures) == 1
