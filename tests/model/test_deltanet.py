"""Gated DeltaNet against transformers' own layers (Qwen3_5GatedDeltaNet, Qwen3NextGatedDeltaNet).

A tiny layer (hidden 64, 2 key heads, 4 value heads, head dims 16, conv kernel 4, float32) gets
random values in every parameter (A_log, dt_bias and the gated norm's gamma included: their
defaults would hide a wrong transform), is converted to the GGUF layout as llama.cpp's converter
does (tests/fixtures/qwen_hybrid_weights.py: tiled value heads for qwen35, grouped for qwen3next),
and run by Bubo: prefill from an empty state, prefill then single-token decode, chunked prefill
against the token-by-token recurrence, and a prefill fed in two pieces. Transformers runs the whole
sequence without a cache; the layer is causal, so its position t is what decode step t must give.
Measured max |Δ| (outputs of magnitude ~2): 5e-7 prefill, 1.2e-6 decode, 2.4e-6 between
Bubo's own paths (tolerance 1e-4).
"""

import pytest
import torch
from torch import nn
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from bubo.model.deltanet import GatedDeltaNet
from bubo.model.state import DeltaNetState
from tests.fixtures.gguf_writer import randomize_
from tests.fixtures.qwen_hybrid_weights import (
    HybridArch,
    LinearAttentionDims,
    convert_linear_attention,
    reorder_v_heads,
)

TOLERANCE = 1e-4
HIDDEN, BATCH, LENGTH = 64, 2, 70
ARCHS: list[HybridArch] = ["qwen35", "qwen3next"]
DIMS = {
    "hidden_size": HIDDEN,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
    "rms_norm_eps": 1e-6,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def _pair(arch: HybridArch, gate_activation: str = "silu") -> tuple[nn.Module, GatedDeltaNet]:
    """transformers' layer with random weights, and Bubo's built from its converted GGUF tensors."""
    if arch == "qwen3next":
        config = Qwen3NextConfig(**DIMS)
        reference: nn.Module = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    else:
        config = Qwen3_5TextConfig(**DIMS)
        reference = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    randomize_(reference, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        # Decay rates A from slow to fast, and dt biases of both signs, so that g spans real ranges.
        reference.A_log.copy_(
            torch.empty(config.linear_num_value_heads).uniform_(-2.0, 1.5, generator=generator)
        )
        reference.dt_bias.copy_(torch.randn(config.linear_num_value_heads, generator=generator))
    reference.norm.activation = gate_activation
    reference.eval()

    dims = LinearAttentionDims.from_config(config)
    t = convert_linear_attention(reference.state_dict(), arch, dims, block=0)
    if arch == "qwen3next":
        beta_alpha = {"ssm_ba": _linear(t["blk.0.ssm_ba.weight"])}
    else:
        beta_alpha = {
            "ssm_beta": _linear(t["blk.0.ssm_beta.weight"]),
            "ssm_alpha": _linear(t["blk.0.ssm_alpha.weight"]),
        }
    ours = GatedDeltaNet(
        _linear(t["blk.0.attn_qkv.weight"]),
        _linear(t["blk.0.attn_gate.weight"]),
        t["blk.0.ssm_conv1d.weight"],
        t["blk.0.ssm_a"],
        t["blk.0.ssm_dt.bias"],
        t["blk.0.ssm_norm.weight"],
        _linear(t["blk.0.ssm_out.weight"]),
        num_k_heads=dims.num_k_heads,
        num_v_heads=dims.num_v_heads,
        head_k_dim=dims.head_k_dim,
        head_v_dim=dims.head_v_dim,
        value_head_order="grouped" if arch == "qwen3next" else "tiled",
        norm_eps=config.rms_norm_eps,
        gate_activation=gate_activation,
        **beta_alpha,
    )
    return reference, ours


def _inputs(length: int = LENGTH) -> torch.Tensor:
    return torch.randn(BATCH, length, HIDDEN, generator=torch.Generator().manual_seed(5))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("length", [64, 70])
@torch.no_grad()
def test_prefill_matches_transformers(arch: HybridArch, length: int) -> None:
    reference, ours = _pair(arch)
    x = _inputs(length)
    assert _max_diff(ours(x, ours.new_state(BATCH)), reference(x)) <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_decode_continues_prefill(arch: HybridArch) -> None:
    reference, ours = _pair(arch)
    x = _inputs()
    state = ours.new_state(BATCH)
    steps = [ours(x[:, :40], state)] + [ours(x[:, t : t + 1], state) for t in range(40, LENGTH)]
    assert _max_diff(torch.cat(steps, dim=1), reference(x)) <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_chunked_prefill_equals_recurrence(arch: HybridArch) -> None:
    _, ours = _pair(arch)
    x = _inputs()
    chunked, stepped = ours.new_state(BATCH), ours.new_state(BATCH)
    whole = ours(x, chunked)
    tokens = torch.cat([ours(x[:, t : t + 1], stepped) for t in range(LENGTH)], dim=1)
    assert _max_diff(whole, tokens) <= TOLERANCE
    assert _max_diff(chunked.recurrent_state, stepped.recurrent_state) <= TOLERANCE
    assert _max_diff(chunked.conv_state, stepped.conv_state) <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split", [2, 23, 64])
@torch.no_grad()
def test_prefill_in_two_pieces(arch: HybridArch, split: int) -> None:
    _, ours = _pair(arch)
    x = _inputs()
    whole_state, split_state = ours.new_state(BATCH), ours.new_state(BATCH)
    whole = ours(x, whole_state)
    pieces = torch.cat([ours(x[:, :split], split_state), ours(x[:, split:], split_state)], dim=1)
    assert _max_diff(whole, pieces) <= TOLERANCE
    assert _max_diff(whole_state.recurrent_state, split_state.recurrent_state) <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cuts", [[1, 2, 3], [5, 64, 65], [30]])
@torch.no_grad()
def test_states_kept_inside_one_call_equal_the_prefixes_own(arch: HybridArch, cuts: list[int]) -> None:
    """forward_keeping's copy at c equals the state after a separate call on the first c tokens, and
    its output and final state equal transformers' / a plain call's."""
    reference, ours = _pair(arch)
    x = _inputs()
    state = ours.new_state(BATCH)
    out, kept = ours.forward_keeping(x, state, cuts)
    assert _max_diff(out, reference(x)) <= TOLERANCE
    whole = ours.new_state(BATCH)
    ours(x, whole)
    assert _max_diff(state.recurrent_state, whole.recurrent_state) <= TOLERANCE
    assert len(kept) == len(cuts)
    for c, copy in zip(cuts, kept, strict=True):
        prefix = ours.new_state(BATCH)
        ours(x[:, :c], prefix)
        assert _max_diff(copy.conv_state, prefix.conv_state) <= TOLERANCE
        assert _max_diff(copy.recurrent_state, prefix.recurrent_state) <= TOLERANCE


@torch.no_grad()
def test_reset_starts_a_new_sequence() -> None:
    _, ours = _pair("qwen35")
    x = _inputs(10)
    state = ours.new_state(BATCH)
    first = ours(x, state)
    assert state.recurrent_state.abs().sum() > 0
    state.reset()
    assert torch.equal(ours(x, state), first)


def test_state_shapes() -> None:
    state = DeltaNetState.zeros(
        3, conv_channels=96, conv_kernel=4, num_v_heads=4, head_k_dim=16, head_v_dim=8
    )
    assert state.conv_state.shape == (3, 96, 3)
    assert state.recurrent_state.shape == (3, 4, 16, 8)
    assert state.recurrent_state.dtype == torch.float32


@torch.no_grad()
def test_sigmoid_output_gate() -> None:
    """qwen4exp's output_gate_type sigmoid: the only change is the gated norm's activation."""
    reference, ours = _pair("qwen35", gate_activation="sigmoid")
    x = _inputs()
    assert _max_diff(ours(x, ours.new_state(BATCH)), reference(x)) <= TOLERANCE


@torch.no_grad()
def test_wrong_value_head_order_is_detected() -> None:
    """The order flag matters whenever Hk != Hv (here 2 and 4): the test set-up can tell them apart."""
    reference, ours = _pair("qwen35")
    ours.value_head_order = "grouped"
    x = _inputs(8)
    assert _max_diff(ours(x, ours.new_state(BATCH)), reference(x)) > 100 * TOLERANCE


def test_tiled_reorder_moves_head_g_rho_plus_i_to_i_hk_plus_g() -> None:
    dims = LinearAttentionDims(num_k_heads=2, num_v_heads=6, head_k_dim=1, head_v_dim=2)
    grouped = torch.arange(6).repeat_interleave(2)  # head h's two elements are both h
    tiled = reorder_v_heads(grouped, 0, dims, head_dim=2).view(6, 2)[:, 0]
    rho = dims.v_per_k
    assert [tiled[i * dims.num_k_heads + g].item() for g in range(2) for i in range(rho)] == list(range(6))
