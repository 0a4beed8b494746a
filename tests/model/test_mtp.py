"""The MTP block (multi-token prediction) of Qwen3.5, Qwen3.5-MoE and Qwen3-Next against a reference
built from transformers' own modules.

The reference block and the tiny models with one: tests/fixtures/mtp_models.py.
"""

from pathlib import Path

import pytest
import torch

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.loader import load_decoder
from bubo.model.mtp import MultiTokenPredictor
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import HYBRID_SIZES, tiny_hybrid
from tests.fixtures.mtp_models import ReferenceMTP, mtp_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-3
MAIN = ["linear_attention", "full_attention"] * 2
SIZES = HYBRID_SIZES
_model = tiny_hybrid


def _setup(arch: str, tmp_path: Path) -> tuple[ReferenceMTP, torch.nn.Module]:
    reference, path = mtp_model(arch, MAIN, tmp_path / "mtp.gguf")
    f = GGUFFile(path)
    return reference, load_decoder(f, config_from_gguf(f))


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_mtp_matches_the_reference(arch: str, tmp_path: Path) -> None:
    reference, model = _setup(arch, tmp_path)
    assert model.config.num_layers == len(MAIN) and model.config.mtp_layers == 1
    assert isinstance(model.mtp, MultiTokenPredictor)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(3))
    inputs, following = tokens[:, :-1], tokens[:, 1:]
    with torch.inference_mode():
        expected_hidden = reference.main.model(inputs).last_hidden_state
        expected = reference(expected_hidden, following)
        hidden = model.hidden(inputs, model.new_cache(batch=2, max_len=40))
        assert (hidden - expected_hidden).abs().max() <= TOLERANCE
        draft = model.draft_logits(hidden, following, model.new_mtp_cache(batch=2, max_len=40))
        # main logits are unchanged by the extra block
        main_logits = model(inputs, model.new_cache(batch=2, max_len=40))
        assert (main_logits - reference.main(inputs).logits).abs().max() <= TOLERANCE
    delta = (draft - expected).abs().max().item()
    print(f"{arch}: MTP max|Δlogit| {delta:.2e}")
    assert delta <= TOLERANCE


def test_mtp_in_pieces_equals_mtp_at_once(tmp_path: Path) -> None:
    _, model = _setup("qwen35moe", tmp_path)
    tokens = torch.randint(0, SIZES["vocab_size"], (1, 25), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hidden = model.hidden(tokens[:, :-1], model.new_cache(max_len=32))
        whole = model.draft_logits(hidden, tokens[:, 1:], model.new_mtp_cache(max_len=32))
        cache = model.new_mtp_cache(max_len=32)
        pieces = [model.draft_logits(hidden[:, :16], tokens[:, 1:17], cache)]
        pieces += [
            model.draft_logits(hidden[:, t : t + 1], tokens[:, t + 1 : t + 2], cache) for t in range(16, 24)
        ]
    assert (torch.cat(pieces, dim=1) - whole).abs().max() <= 1e-4


def test_a_model_without_mtp_refuses_to_draft(tmp_path: Path) -> None:
    main = _model("qwen35", MAIN)
    randomize_(main)
    f = GGUFFile(write_gguf(main, tmp_path / "plain.gguf"))
    model = load_decoder(f, config_from_gguf(f))
    assert model.mtp is None and model.config.mtp_layers == 0
    with pytest.raises(ValueError, match="no MTP block"):
        model.draft_logits(
            torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long), model.new_mtp_cache(max_len=4)
        )


def test_nextn_layers_without_tensors_are_an_error(tmp_path: Path) -> None:
    main = _model("qwen35", MAIN)
    randomize_(main)
    path = write_gguf(main, tmp_path / "liar.gguf", metadata_overrides={"qwen35.nextn_predict_layers": 1})
    with pytest.raises(Exception, match="nextn"):
        config_from_gguf(GGUFFile(path))


def test_inspect_shows_the_mtp_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bubo import cli

    _setup("qwen35", tmp_path)
    assert cli.main(["inspect", str(tmp_path / "mtp.gguf")]) == 0
    assert (
        "  + MTP block at blk.4 (gated full attention, dense): drafts the token after next"
        in capsys.readouterr().out
    )
