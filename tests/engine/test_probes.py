"""Per-token probes (bubo/engine/probes.py): a long sequence probed a few positions at a time gives what
one pass gives, every pass runs inside `run` (the batcher's compute thread in the server) with no hook
left between them, and a slot returns the probe with its Finished event."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bubo.engine import probes
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.probes import ProbeSpec, TokenProbe, check_probe, probe_tokens
from bubo.engine.request import Finished, GenerationRequest
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import SessionSlot
from bubo.model.trace import is_traced

SPEC = ProbeSpec(router=(0, 1), logit_lens=(0, 1), residual_norm=(1,), top_k=4)
PROMPT, TOKENS = list(range(40, 47)), [60, 61, 62, 63, 64, 65, 66]


def _same(a: list[TokenProbe], b: list[TokenProbe]) -> None:
    assert [(p.position, p.token_id, p.text) for p in a] == [(p.position, p.token_id, p.text) for p in b]
    for x, y in zip(a, b, strict=True):
        assert {k: [e for e, _ in v] for k, v in x.router.items()} == {
            k: [e for e, _ in v] for k, v in y.router.items()
        }
        for layer, top in x.logit_lens.items():
            assert [t for t, _, _ in top] == [t for t, _, _ in y.logit_lens[layer]]
            assert [p for _, _, p in top] == pytest.approx([p for _, _, p in y.logit_lens[layer]], abs=1e-4)
        assert x.residual_norm == pytest.approx(y.residual_norm, rel=1e-5)


def test_pieces_give_what_one_pass_gives(tiny_moe: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = tiny_moe.model, tiny_moe.tokenizer
    whole = probe_tokens(model, tokenizer, PROMPT, TOKENS, SPEC)
    assert [p.position for p in whole] == list(range(len(PROMPT) - 1, len(PROMPT) + len(TOKENS) - 1))
    assert [p.token_id for p in whole] == TOKENS
    monkeypatch.setattr(probes, "_PIECE", 3)
    inside, outside, pieces = [False], [], []

    def run(work: Callable[[], Any]) -> Any:
        assert not is_traced(model)
        inside[0] = True
        try:
            pieces.append(work())
        finally:
            inside[0] = False
        assert not is_traced(model)
        return pieces[-1]

    handle = model.register_forward_pre_hook(lambda *_: outside.append(not inside[0]))
    try:
        split = probe_tokens(model, tokenizer, PROMPT, TOKENS, SPEC, run)
    finally:
        handle.remove()
    _same(split, whole)
    # The 6 positions before the first chosen token in 2 pieces, then the 7 traced ones in 3.
    assert len(pieces) == 5 and len(outside) == 5 and not any(outside)
    assert probe_tokens(model, tokenizer, PROMPT, [], SPEC) == []


def test_check_probe_names_the_kind(tiny_moe: LoadedModel, tiny_llama: LoadedModel) -> None:
    check_probe(tiny_moe.model, SPEC)
    with pytest.raises(ValueError, match="router: layer 0 has no router site"):
        check_probe(tiny_llama.model, ProbeSpec(router=(0,)))
    with pytest.raises(ValueError, match="logit_lens: layer 2 is out of range"):
        check_probe(tiny_llama.model, ProbeSpec(logit_lens=(2,)))
    with pytest.raises(ValueError, match="can't be probed"):
        check_probe(torch.nn.Linear(2, 2), SPEC)


def test_a_slot_answers_with_the_probe(tiny_moe: LoadedModel) -> None:
    """The generation's own tokens, each with the captures of the pass that chose it: greedy, the last
    layer's lens puts it first."""
    slot = SessionSlot(tiny_moe.model, tiny_moe.tokenizer, 64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    *_, finished = slot.events(GenerationRequest("r", "", PROMPT, params, probe=SPEC))
    assert isinstance(finished, Finished) and finished.probe is not None
    assert [p.token_id for p in finished.probe] == finished.result.token_ids
    assert all(p.logit_lens[1][0][0] == p.token_id for p in finished.probe)
    _same(
        list(finished.probe),
        probe_tokens(tiny_moe.model, tiny_moe.tokenizer, PROMPT, finished.result.token_ids, SPEC),
    )
    *_, plain = slot.events(GenerationRequest("s", "", PROMPT, params))
    assert isinstance(plain, Finished) and plain.probe is None
    assert plain.result.token_ids == finished.result.token_ids
