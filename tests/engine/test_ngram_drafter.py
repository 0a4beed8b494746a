"""Prompt-lookup drafting (bubo/engine/ngram_drafter.py): what it proposes, and generation with it against
plain decoding of the same model — on a tiny model (verified by the eager pass) and on the default model,
whose verify passes run through the compiled step's several-token pass."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bubo.engine.drafters import drafter_for
from bubo.engine.generate import GenerationResult, generate
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.ngram_drafter import NgramDrafter
from bubo.engine.runner import runner_for
from bubo.engine.sampler import SamplingParams
from bubo.engine.speculative import Draft
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model import quantized_linear
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from tests.engine.test_speculative import ByteTokenizer
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.model.test_decoder import CASES


def _never_called(row: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    raise AssertionError("an n-gram drafter draws nothing from the model")


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    drafter = NgramDrafter(max_draft=3, size_n=2)
    drafter.start(100)
    context = [1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 8, 1, 2]
    # [1, 2] occurred at 0 (then 3 4 9) and at 5 (then 5 6 7): the latest wins.
    assert drafter.propose(context, None, 3, _never_called).tokens == [5, 6, 7]
    # No more than asked, and none when asked for none.
    assert drafter.propose(context, None, 1, _never_called).tokens == [5]
    assert drafter.propose(context, None, 0, _never_called).tokens == []
    # An n-gram seen only as the newest tokens has no earlier occurrence.
    assert drafter.propose([*context, 40, 41], None, 3, _never_called).tokens == []
    # The context grows between rounds: the positions since the last round are indexed too, the earlier
    # newest n-gram included ([40, 41] then 50).
    assert drafter.propose([*context, 40, 41, 50, 40, 41], None, 3, _never_called).tokens == [50, 40, 41]
    # A continuation that runs into the newest tokens stops at the end of the context.
    drafter.start(100)
    assert drafter.propose([7, 7, 7, 7], None, 3, _never_called).tokens == [7]


def test_a_new_sequence_forgets_the_last_ones_ngrams() -> None:
    drafter = NgramDrafter(max_draft=2, size_n=1)
    drafter.start(100)
    assert drafter.propose([4, 5, 4], None, 2, _never_called).tokens == [5, 4]
    drafter.start(100)
    assert drafter.propose([6, 4], None, 2, _never_called).tokens == []


def test_drafter_choice() -> None:
    model = object()  # the n-gram drafter never touches the model
    ngram = drafter_for(model, "ngram-simple", None, 4)  # type: ignore[arg-type]
    assert isinstance(ngram, NgramDrafter) and ngram.max_draft == 2 and ngram.size_n == 4
    assert drafter_for(model, "ngram-simple", 0) is None  # type: ignore[arg-type]
    assert drafter_for(model, "none", 3) is None  # type: ignore[arg-type]
    assert drafter_for(model, None, None) is None  # type: ignore[arg-type]  # no MTP block
    with pytest.raises(ValueError, match="no MTP block"):
        drafter_for(model, "mtp", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spec-type"):
        drafter_for(model, "eagle", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size-n"):
        drafter_for(model, "ngram-simple", 2, 0)  # type: ignore[arg-type]


def _run(
    model: Decoder, tokenizer: object, prompt: list[int], params: SamplingParams, drafter: object
) -> tuple:
    cache = model.new_cache(max_len=len(prompt) + (params.max_tokens or 0) + 1)
    result = list(generate(model, tokenizer, prompt, params, cache=cache, drafter=drafter))[-1]  # type: ignore[arg-type]
    assert isinstance(result, GenerationResult)
    return result, cache


@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory: pytest.TempPathFactory) -> Decoder:
    """A tiny llama whose matrices are packed for the matvecs, so it decodes through the compiled step."""
    reference = CASES["llama-tied"]()
    randomize_(reference, seed=5)
    path = write_gguf(reference, tmp_path_factory.mktemp("ngram") / "llama.gguf", quantize={"blk.*": Q.Q4_0})
    file = GGUFFile(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
        return load_decoder(file, config_from_gguf(file), dtype=torch.float32)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("max_draft", [1, 3])
def test_greedy_output_and_cache_are_plain_decodings(
    packed_llama: Decoder, compiled: bool, max_draft: int, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    if not compiled:
        runtime_options(compile_decode=False)
    # A repetitive prompt: the random model's greedy continuation soon repeats too, so rounds draft,
    # some drafts are kept and some are not.
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    plain, plain_cache = _run(packed_llama, ByteTokenizer(), prompt, params, None)
    spec, spec_cache = _run(packed_llama, ByteTokenizer(), prompt, params, NgramDrafter(max_draft, 2))
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.draft_accepted <= spec.draft_tokens
    assert spec_cache.length == plain_cache.length == len(prompt) + len(plain.token_ids) - 1
    for layer in range(plain_cache.num_layers):
        for a, b in zip(spec_cache.read(layer), plain_cache.read(layer), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


class FirstRightDrafter:
    """Drafts without hidden states (as the n-gram drafter does) from plain decoding's known output:
    right on its first token, wrong after, so every round of two or more drafts is cut short."""

    needs_hidden = False

    def __init__(self, expected: list[int], max_draft: int) -> None:
        self.expected, self.max_draft = expected, max_draft
        self.rounds: list[int] = []

    def start(self, max_len: int) -> None:
        self.rounds = []

    def propose(self, context: list[int], hidden: object, n: int, draw_draft: object) -> Draft:
        self.rounds.append(n)
        right = [self.expected[len(context) + i] for i in range(n)]
        return Draft([token if i == 0 else (token + 1) % 256 for i, token in enumerate(right)])


@pytest.mark.parametrize("compiled", [False, True])
def test_rejected_drafts_are_rolled_back(
    packed_llama: Decoder, compiled: bool, monkeypatch: pytest.MonkeyPatch, runtime_options
) -> None:
    if not compiled:
        runtime_options(compile_decode=False)
    prompt = [3, 17, 42, 7, 99]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    plain, plain_cache = _run(packed_llama, ByteTokenizer(), prompt, params, None)
    drafter = FirstRightDrafter(prompt + plain.token_ids + [0] * 4, 3)
    spec, spec_cache = _run(packed_llama, ByteTokenizer(), prompt, params, drafter)
    assert spec.token_ids == plain.token_ids
    assert (runner_for(packed_llama).decode_step(spec_cache) is not None) == compiled
    assert spec.draft_tokens == sum(drafter.rounds) and spec.draft_accepted == sum(
        min(n, 1) for n in drafter.rounds
    )
    assert max(drafter.rounds) == 3
    assert spec_cache.length == plain_cache.length
    for layer in range(plain_cache.num_layers):
        for x, y in zip(spec_cache.read(layer), plain_cache.read(layer), strict=True):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=0)


def test_sampling_keeps_its_counts_and_the_context_limit(packed_llama: Decoder) -> None:
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40)
    spec, cache = _run(packed_llama, ByteTokenizer(), prompt, params, NgramDrafter(3, 1))
    assert spec.completion_tokens == 40 and spec.draft_tokens > 0
    assert 0 <= spec.draft_accepted <= spec.draft_tokens
    assert cache.length == len(prompt) + 39


def test_default_model_copies_text_at_several_tokens_a_pass(smollm2: LoadedModel) -> None:
    """The real model through the compiled step: the same greedy text, and most of a repeated passage
    accepted from drafts."""
    tokenizer = smollm2.tokenizer
    passage = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
        "single step. All that glitters is not gold."
    )
    prompt = tokenizer.encode(f"{passage}\n\n{passage}\n\n{passage[:19]}")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = list(generate(smollm2.model, tokenizer, prompt, params))[-1]
    spec = list(generate(smollm2.model, tokenizer, prompt, params, drafter=NgramDrafter(3)))[-1]
    assert isinstance(plain, GenerationResult) and isinstance(spec, GenerationResult)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.text.startswith(passage[19:44])
    assert spec.draft_accepted >= 12
