"""qwen4exp's MTP block (bubo/model/hyper_connected_mtp.py) against a reference composed of
transformers' own Qwen4Exp modules, wired as vLLM wires them (tests/fixtures/qwen4exp_mtp.py).

The tiny model is spec 7.1's (8 layers, 4 streams, QSA from position 11, PLE); the block is loaded from
a GGUF (inside block_count or past it, both mixer names) and from a checkpoint shard (`--mtp-weights`).
Measured max |Δlogit| of the draft logits against the reference: 2.2e-5 (tolerance 1e-3); a
per-stream hidden norm (llama.cpp's) moves them by 0.36, swapped eh_proj halves by 5.6.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bubo import cli
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.model import hyper_connected_mtp
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import IndexedAttentionMixer
from bubo.model.hyper_connected_mtp import HyperConnectedMTP
from bubo.model.loader import load_decoder
from bubo.model.mtp_weights import MTPWeightsError, load_mtp_weights
from tests.fixtures.qwen4exp_gguf import write_qwen4exp_gguf
from tests.fixtures.qwen4exp_mtp import ReferenceQwen4ExpMTP, qwen4exp_mtp_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md)
LENGTH = 24  # QSA drops blocks from position 11 (budget 2 blocks of 4)


def _load(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


def _tokens(batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, LENGTH + 1), generator=torch.Generator().manual_seed(seed))


def _deltas(reference: ReferenceQwen4ExpMTP, model: Decoder) -> tuple[float, float]:
    """max |Δ| of the draft logits and of the block's output streams, rows 0..LENGTH-1 of two sequences."""
    tokens = _tokens()
    inputs, following = tokens[:, :-1], tokens[:, 1:]
    with torch.inference_mode():
        expected, expected_streams = reference(reference.streams(inputs), following)
        _, streams = model.hidden_and_mtp_input(inputs, model.new_cache(batch=2, max_len=32))
        head_input, chained = model.draft_hidden(streams, following, model.new_mtp_cache(batch=2, max_len=32))
        logits = model.draft_head(head_input)
    return (logits - expected).abs().max().item(), (chained - expected_streams).abs().max().item()


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceQwen4ExpMTP, Path, Path]:
    """The reference, the GGUF with the block inside block_count, and the same model without it."""
    folder = tmp_path_factory.mktemp("q4mtp")
    reference, path = qwen4exp_mtp_model(folder / "with.gguf")
    return reference, path, write_qwen4exp_gguf(reference.main, folder / "without.gguf")


@pytest.mark.parametrize(
    ("inside", "mixer", "own_head"),
    [(True, "nextn.hc_head", False), (False, "output_hc", False), (True, "nextn.hc_head", True)],
)
def test_draft_logits_match_the_reference(tmp_path: Path, inside: bool, mixer: str, own_head: bool) -> None:
    reference, path = qwen4exp_mtp_model(tmp_path / "m.gguf", inside=inside, mixer=mixer, own_head=own_head)
    model = _load(path)
    assert model.config.num_layers == 8 and model.config.mtp_layers == 1
    assert isinstance(model.mtp, HyperConnectedMTP) and (model.mtp.head is not None) == own_head
    assert isinstance(model.mtp.layer.attention, IndexedAttentionMixer)  # vLLM's QSA draft layer
    logits, streams = _deltas(reference, model)
    print(f"qwen4exp MTP: max|Δlogit| {logits:.2e}, max|Δstreams| {streams:.2e}")
    assert logits <= TOLERANCE and streams <= TOLERANCE


def test_mutations_of_the_forward_fail_the_comparison(
    block: tuple[ReferenceQwen4ExpMTP, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's per-stream hidden norm, or eh_proj's halves swapped, are caught by the bound."""
    reference, path, _ = block
    model = _load(path)
    assert model.mtp is not None
    norm = hyper_connected_mtp.grouped_rms_norm
    with monkeypatch.context() as patch:
        # one RMS per stream wherever the block normalises the streams
        patch.setattr(
            hyper_connected_mtp,
            "grouped_rms_norm",
            lambda x, gamma, groups, eps: norm(x, gamma, 4 if x.shape[-1] == 256 else groups, eps),
        )
        assert _deltas(reference, model)[0] > 100 * TOLERANCE
    weight = model.mtp.eh_proj.weight
    with torch.no_grad():
        weight.copy_(torch.cat([weight[:, 64:], weight[:, :64]], dim=1))
    assert _deltas(reference, model)[0] > 100 * TOLERANCE


def test_drafting_in_pieces_equals_drafting_at_once(block: tuple[ReferenceQwen4ExpMTP, Path, Path]) -> None:
    """The block's KV cache and QSA indexer state carry the rows between calls."""
    model = _load(block[1])
    tokens = _tokens(batch=1)
    with torch.inference_mode():
        _, streams = model.hidden_and_mtp_input(tokens[:, :-1], model.new_cache(max_len=32))
        whole = model.draft_logits(streams, tokens[:, 1:], model.new_mtp_cache(max_len=32))
        cache = model.new_mtp_cache(max_len=32)
        pieces = [model.draft_logits(streams[:, :9], tokens[:, 1:10], cache)]
        pieces += [
            model.draft_logits(streams[:, t : t + 1], tokens[:, t + 1 : t + 2], cache) for t in range(9, 24)
        ]
    assert cache.indexers[0].length == cache.length == LENGTH
    assert (torch.cat(pieces, dim=1) - whole).abs().max() <= 1e-4


def test_a_file_that_runs_qsa_dense_runs_the_block_dense(tmp_path: Path) -> None:
    """Every compress ratio 0 (spec 2.3): the trunk's attention layers run dense, as llama.cpp runs
    them, and so does the block; the reference selects every block with a budget covering the sequence."""
    zeros = {"qwen4exp.attention.compress_ratios": [0] * 9}
    reference, path = qwen4exp_mtp_model(tmp_path / "dense.gguf", metadata=zeros, indexer_budget=LENGTH + 4)
    with pytest.warns(UserWarning, match="compress_ratios"):
        model = _load(path)
    assert model.mtp is not None and type(model.mtp.layer.attention) is Attention
    logits, streams = _deltas(reference, model)
    assert logits <= TOLERANCE and streams <= TOLERANCE


def test_the_gguf_block_is_refused_with_one_line(
    block: tuple[ReferenceQwen4ExpMTP, Path, Path], tmp_path: Path
) -> None:
    reference = block[0]
    tensors = reference.gguf_tensors()
    no_mixer = {k: v for k, v in tensors.items() if "hc_head" not in k}
    wrong_hnorm = {**tensors, "blk.8.nextn.hnorm.weight": torch.ones(64)}
    for extra, message in (
        (no_mixer, "missing tensor 'blk.8.nextn.hc_head_norm.weight'"),
        (wrong_hnorm, "'blk.8.nextn.hnorm.weight' has shape (64,), expected (256,)"),
    ):
        path = write_qwen4exp_gguf(
            reference.main, tmp_path / "bad.gguf", extra_tensors=extra, nextn_predict_layers=1
        )
        with pytest.raises(GGUFError) as error:
            _load(path)
        assert message in str(error.value) and "\n" not in str(error.value)


def test_inspect_shows_the_block(block: tuple[ReferenceQwen4ExpMTP, Path, Path], capsys) -> None:
    assert cli.main(["inspect", str(block[1])]) == 0
    out = capsys.readouterr().out
    assert "8 layers, 4 hyper-connected residual streams" in out
    assert "  + MTP block at blk.8 (hyper-connected QSA attention, sparse_moe_shared): drafts" in out


@pytest.mark.parametrize("per_expert", [False, True])
def test_checkpoint_block_drafts_like_the_gguf_block(
    block: tuple[ReferenceQwen4ExpMTP, Path, Path], tmp_path: Path, per_expert: bool
) -> None:
    reference, _, without = block
    tensors = reference.checkpoint_tensors()
    # vLLM drops the final mixer's inject weight; a checkpoint may still hold one
    tensors["mtp.hyper_connection_mixer.block_inject_weight.weight"] = torch.zeros(4, 256)
    if per_expert:  # how the released checkpoints store experts, before transformers fuses them
        prefix = "mtp.layers.0.mlp.experts."
        gate, up = tensors.pop(prefix + "gate_up_proj").chunk(2, dim=1)
        down = tensors.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            for kind, stack in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                tensors[f"{prefix}{e}.{kind}.weight"] = stack[e].contiguous()
    tensors["model.language_model.norm.weight"] = torch.ones(4)  # a shard holds more: only mtp.* is read
    save_file(tensors, tmp_path / "shard.safetensors")
    model = _load(without)
    assert model.mtp is None
    load_mtp_weights(model, tmp_path / "shard.safetensors")
    assert isinstance(model.mtp, HyperConnectedMTP)
    logits, streams = _deltas(reference, model)
    assert logits <= TOLERANCE and streams <= TOLERANCE


def test_checkpoint_with_its_own_head(tmp_path: Path) -> None:
    reference, _ = qwen4exp_mtp_model(tmp_path / "m.gguf", own_head=True, with_block=False)
    save_file(reference.checkpoint_tensors(), tmp_path / "shard.safetensors")
    model = _load(tmp_path / "m.gguf")
    load_mtp_weights(model, tmp_path / "shard.safetensors")
    assert isinstance(model.mtp, HyperConnectedMTP) and model.mtp.head is not None
    assert _deltas(reference, model)[0] <= TOLERANCE


def test_bad_checkpoints_are_refused_with_one_line(
    block: tuple[ReferenceQwen4ExpMTP, Path, Path], tmp_path: Path
) -> None:
    reference, _, without = block
    good = reference.checkpoint_tensors()
    model = _load(without)
    index_qk = "mtp.layers.0.self_attn.indexer.index_qk_proj.weight"
    cases = [
        ({**good, "mtp.fc_hidden.weight": torch.zeros(64, 128)}, "mtp.fc_hidden.weight has shape (64, 128)"),
        (
            {**good, "mtp.pre_fc_norm_hidden.weight": torch.zeros(64)},
            "mtp.pre_fc_norm_hidden.weight has shape (64,), this model's MTP block needs (256,)",
        ),
        ({k: v for k, v in good.items() if k != "mtp.fc_embedding.weight"}, "no mtp.fc_embedding.weight"),
        (
            {k: v for k, v in good.items() if "hyper_connection_mixer.hc_norm" not in k},
            "no mtp.hyper_connection_mixer.hc_norm.weight",
        ),
        ({**good, index_qk: torch.zeros(32, 64)}, f"{index_qk} has shape (32, 64)"),
        ({**good, "mtp.norm.weight": torch.zeros(64)}, "mtp.norm.weight (and 0 more) don't fit"),
    ]
    for tensors, message in cases:
        save_file(tensors, tmp_path / "bad.safetensors")
        with pytest.raises(MTPWeightsError) as error:
            load_mtp_weights(model, tmp_path / "bad.safetensors")
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
        assert model.mtp is None
