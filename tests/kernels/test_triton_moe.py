"""The fused Triton MoE kernel against SparseMoE's plain-torch expert loop on float experts (gguf's
numpy dequantization of the same blocks), and SparseMoE's use of it."""

import gguf
import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from bubo.kernels import triton_moe
from bubo.kernels.triton_moe import fused_moe, group_by_expert
from bubo.model import moe
from bubo.model.moe import ExpertMatrices, QuantizedExpertMatrices, SparseMoE
from tests.kernels.quant_blocks import device, random_blocks, reference_weight

Q = gguf.GGMLQuantizationType
NUM_EXPERTS, TOP_K = 6, 2


def _experts(
    qtype: Q, out_features: int, in_features: int, seed: int
) -> tuple[QuantizedExpertMatrices, ExpertMatrices]:
    # Scales that keep weights about unit size: an IQ4_XS weight reaches 4064 d, a Q8_0 one 127 d.
    block_scales = (0.003, 0.01) if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else (1e-4, 3e-4)
    raw = random_blocks(qtype, NUM_EXPERTS * out_features, in_features, seed, magnitudes=block_scales)
    weight = reference_weight(raw, qtype).float().view(NUM_EXPERTS, out_features, in_features)
    blocks = torch.from_numpy(raw).view(NUM_EXPERTS, out_features, -1).to(device())
    return QuantizedExpertMatrices(blocks, qtype, in_features), ExpertMatrices(weight.to(device()))


def _moe(types: tuple[Q, Q, Q], hidden: int, intermediate: int) -> tuple[SparseMoE, SparseMoE]:
    """(the model with quantized experts, the same model with their float64-exact float32 values)."""
    gate, up, down = types
    q_gate, f_gate = _experts(gate, intermediate, hidden, seed=1)
    q_up, f_up = _experts(up, intermediate, hidden, seed=2)
    q_down, f_down = _experts(down, hidden, intermediate, seed=3)
    router = nn.Linear(hidden, NUM_EXPERTS, bias=False).to(device())
    return (
        SparseMoE(router, q_gate, q_up, q_down, TOP_K, norm_topk_prob=True),
        SparseMoE(router, f_gate, f_up, f_down, TOP_K, norm_topk_prob=True),
    )


def _routing(model: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(model.router(x), dim=-1)
    weights, chosen = probs.topk(TOP_K, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


TYPE_SETS = [
    (Q.Q4_0, Q.Q8_0, Q.Q4_1),  # three different 32-weight types, hidden 96: ragged K tiles
    (Q.Q4_K, Q.Q4_K, Q.Q6_K),  # Q4_K_M's usual experts
    (Q.IQ4_XS, Q.Q5_K, Q.Q3_K),
]


# A decode step (the one-token kernels), a few slots and a prefill (the tile kernels; several
# tiles for some experts). The interpreter is slow on the 256-wide K-quant matrices, so those
# sets run the two ends only.
CASES = [(TYPE_SETS[0], 1), (TYPE_SETS[0], 3), (TYPE_SETS[0], 37)]
CASES += [(types, tokens) for types in TYPE_SETS[1:] for tokens in (1, 37)]
# The flagship's decode mix (Q4_K gate, Q5_0 up) with a Q4_K down: the int32-word Q4_K path both ways.
CASES += [((Q.Q4_K, Q.Q5_0, Q.Q4_K), 1)]


@pytest.mark.parametrize(
    ("types", "tokens"), CASES, ids=[f"{'-'.join(q.name for q in t)}-{n}" for t, n in CASES]
)
@torch.inference_mode()
def test_fused_moe_matches_the_expert_loop(types: tuple[Q, Q, Q], tokens: int) -> None:
    hidden, intermediate = (96, 64) if types[0] == Q.Q4_0 else (256, 256)
    quantized, reference = _moe(types, hidden, intermediate)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(device())
    weights, chosen = _routing(quantized, x)
    got = fused_moe(x, weights, chosen, quantized.gate, quantized.up, quantized.down)
    expected = reference(x)
    # float32 throughout: sums of a few hundred products in another order, |y| up to ~10.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


def test_group_by_expert_puts_every_pair_once_in_a_tile_of_its_expert() -> None:
    chosen = torch.randint(0, NUM_EXPERTS, (29, 3), generator=torch.Generator().manual_seed(0))
    chosen[:, 1] = 4  # one expert with many tokens: several tiles
    block_m = 4
    pairs, tile_expert = group_by_expert(chosen, NUM_EXPERTS, block_m)
    n_pairs = chosen.numel()
    tiles = pairs.view(-1, block_m)
    assert tiles.shape[0] == tile_expert.shape[0]
    real = pairs[pairs < n_pairs]
    assert sorted(real.tolist()) == list(range(n_pairs))
    flat = chosen.reshape(-1)
    for tile, expert in zip(tiles.tolist(), tile_expert.tolist(), strict=True):
        members = [p for p in tile if p < n_pairs]
        if expert == NUM_EXPERTS:
            assert not members  # an unused tile at the end
        else:
            assert members and all(flat[p] == expert for p in members)
    used = (tile_expert < NUM_EXPERTS).sum().item()
    assert used == sum(-(-(flat == e).sum().item() // block_m) for e in range(NUM_EXPERTS))
    assert (tile_expert[:used].diff() >= 0).all() and (tile_expert[used:] == NUM_EXPERTS).all()


def test_no_tokens() -> None:
    quantized, _ = _moe(TYPE_SETS[0], 96, 64)
    x = torch.zeros(0, 96).to(device())
    routing = torch.zeros(0, TOP_K).to(device())
    chosen = torch.zeros(0, TOP_K, dtype=torch.long).to(device())
    assert fused_moe(x, routing, chosen, quantized.gate, quantized.up, quantized.down).shape == (0, 96)


def test_mismatched_stacks_are_refused() -> None:
    quantized, _ = _moe(TYPE_SETS[0], 96, 64)
    x = torch.randn(2, 64).to(device())
    weights, chosen = torch.ones(2, TOP_K).to(device()), torch.zeros(2, TOP_K, dtype=torch.long).to(device())
    with pytest.raises(ValueError, match="do not fit together"):
        fused_moe(x, weights, chosen, quantized.gate, quantized.up, quantized.down)


@torch.inference_mode()
def test_sparse_moe_uses_the_fused_kernel_where_enabled(monkeypatch) -> None:
    calls = []

    def counting_fused_moe(*args):
        calls.append(args[0].shape)
        return fused_moe(*args)

    quantized, reference = _moe(TYPE_SETS[0], 96, 64)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(3)).to(device())
    monkeypatch.setattr(moe, "triton_enabled", lambda device: True)
    monkeypatch.setattr(triton_moe, "fused_moe", counting_fused_moe)
    got = quantized(x)
    assert calls == [(10, 96)]
    expected = reference(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    # Float experts keep the loop.
    reference(x)
    assert len(calls) == 1
