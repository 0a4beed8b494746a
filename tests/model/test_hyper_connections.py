"""qwen4exp hyper-connections against transformers' Qwen4ExpTextGatedResidual.

The spec's unit-test config (section 7.1: hidden 64, 4 streams, rank 16) builds the per-block
mixer and the final one (no inject weight); every parameter gets random values (the norm weights
too: transformers initialises them to 0, under which a lost +1 would go unnoticed), the tensors are
converted as llama.cpp's converter does (spec 3.2: hc_norm + 1, the rest as is), and Bubo's module
runs on random streams. The write-back is checked against Qwen4ExpTextDecoderLayer's own formula.
Measured max |Δ| (float32): 0 (the same operations in the same order; tolerance 1e-4).
"""

import pytest
import torch
from torch import nn
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

from bubo.model.hyper_connections import HyperConnection, StreamMixer, expand_streams

TOLERANCE = 1e-4
HIDDEN, STREAMS, RANK = 64, 4, 16
EPS = 1e-6


def _config() -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(hidden_size=HIDDEN, hc_count=STREAMS, hc_lowrank=RANK, rms_norm_eps=EPS)


def _random_residual(use_combine: bool, seed: int) -> Qwen4ExpTextGatedResidual:
    module = Qwen4ExpTextGatedResidual(_config(), use_combine=use_combine)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return module.eval()


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


def _gguf_tensors(module: Qwen4ExpTextGatedResidual) -> dict[str, torch.Tensor]:
    """The module's tensors under their GGUF suffixes (blk.N.hc_attn_* / output_hc_*), torch-shaped.

    The converter folds the (1 + w) of every HF `norm.weight` into the stored gamma (spec 3.6).
    """
    tensors = {
        "norm": module.hc_norm.weight.detach() + 1,
        "down": module.input_mix_weight_down.weight.detach(),
        "up": module.input_mix_weight_up.weight.detach(),
    }
    if module.block_inject_weight is not None:
        tensors["inject"] = module.block_inject_weight.weight.detach()
    return tensors


def _streams(seed: int, batch: int = 2, length: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Streams of different scales, so a norm over all of them instead of each one would show.
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat_interleave(HIDDEN)
    return torch.randn(batch, length, STREAMS * HIDDEN, generator=generator) * scales


def test_block_mixer_matches_transformers() -> None:
    reference = _random_residual(use_combine=True, seed=1)
    t = _gguf_tensors(reference)
    ours = HyperConnection(
        t["norm"],
        _linear(t["down"]),
        _linear(t["up"]),
        _linear(t["inject"]),
        hc_count=STREAMS,
        norm_eps=EPS,
    )
    streams = _streams(seed=2)
    block_output = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected_input, hyper_input, expected_weights = reference(streams)
        # Qwen4ExpTextDecoderLayer's write-back of the block output into the streams.
        expected_streams = hyper_input + (
            block_output.unsqueeze(-2) * expected_weights.unsqueeze(-1)
        ).flatten(-2)
        block_input, weights = ours(streams)
        new_streams = HyperConnection.combine(streams, weights, block_output)
    assert block_input.shape == (2, 7, HIDDEN) and weights.shape == (2, 7, STREAMS)
    assert (block_input - expected_input).abs().max() <= TOLERANCE
    assert (weights - expected_weights).abs().max() <= TOLERANCE
    assert (new_streams - expected_streams).abs().max() <= TOLERANCE


def test_final_reduction_matches_transformers() -> None:
    reference = _random_residual(use_combine=False, seed=4)
    t = _gguf_tensors(reference)
    ours = StreamMixer(t["norm"], _linear(t["down"]), _linear(t["up"]), hc_count=STREAMS, norm_eps=EPS)
    streams = _streams(seed=5)
    with torch.no_grad():
        assert (ours(streams) - reference(streams)).abs().max() <= TOLERANCE


def test_expand_streams_copies_the_embedding_into_every_stream() -> None:
    embedding = torch.randn(2, 3, HIDDEN)
    # Qwen4ExpTextModel.forward: hidden_states.repeat(1, 1, hc_count)
    assert torch.equal(expand_streams(embedding, STREAMS), embedding.repeat(1, 1, STREAMS))
    assert torch.equal(expand_streams(embedding[0, 0], STREAMS), embedding[0, 0].repeat(STREAMS))


def test_rejects_mismatched_streams() -> None:
    t = _gguf_tensors(_random_residual(use_combine=False, seed=6))
    mixer = StreamMixer(t["norm"], _linear(t["down"]), _linear(t["up"]), hc_count=STREAMS, norm_eps=EPS)
    with pytest.raises(ValueError, match="streams"):
        mixer(torch.zeros(1, 1, HIDDEN))
    with pytest.raises(ValueError, match="hc > 1"):
        StreamMixer(t["norm"], _linear(t["down"]), _linear(t["up"]), hc_count=1, norm_eps=EPS)
