"""The Triton gated delta rule (fused recurrent step, chunked prefill) against deltanet.py's torch
recurrence, from a non-zero state, on ragged lengths that end mid-chunk. On the CPU the kernels run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from bubo.kernels import triton_gated_delta
from bubo.model import deltanet

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch: int, heads: int, length: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs shaped and scaled as GatedDeltaNet feeds them: l2-normed q (scaled) and k laid out
    [B, T, H, d] and viewed [B, H, T, d], log decays g < 0, beta in (0, 1), a state of a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, length, heads, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(batch, length, heads, generator=gen))
    state = torch.randn(batch, heads, dk, dv, generator=gen) * 0.3
    return (
        *(x.transpose(1, 2).to(DEVICE) for x in (q, k, v, g, beta)),
        state.to(DEVICE),
    )


def _reference(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    *qkvgb, state = (x.cpu() for x in inputs)
    state = state.clone()
    return deltanet.recurrent_gated_delta_rule(*qkvgb, state), state


@pytest.mark.parametrize(("length", "dk", "dv"), [(1, 16, 32), (3, 24, 20), (9, 32, 64)])
def test_recurrent_step_matches_the_torch_recurrence(length: int, dk: int, dv: int) -> None:
    inputs = _inputs(2, 3, length, dk, dv, seed=length)
    expected, expected_state = _reference(inputs)
    *qkvgb, state = inputs
    out = triton_gated_delta.recurrent_gated_delta_rule(*qkvgb, state)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.cpu(), expected_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("length", "dk", "dv", "chunk"), [(2, 16, 16, 16), (37, 16, 32, 16), (100, 24, 20, 32), (70, 32, 32, 64)]
)
def test_chunked_prefill_matches_the_torch_recurrence(length: int, dk: int, dv: int, chunk: int) -> None:
    inputs = _inputs(2, 3, length, dk, dv, seed=length + chunk)
    expected, expected_state = _reference(inputs)
    *qkvgb, state = inputs
    out = triton_gated_delta.chunked_gated_delta_rule(*qkvgb, state, chunk_size=chunk)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.cpu(), expected_state, atol=1e-4, rtol=1e-4)


def test_a_prompt_in_pieces_then_decode_equals_one_pass() -> None:
    """Chunked pieces and recurrent steps hand the state on exactly as the torch paths do."""
    inputs = _inputs(1, 2, 45, 16, 16, seed=7)
    expected, expected_state = _reference(inputs)
    *qkvgb, state = inputs
    pieces = [
        triton_gated_delta.chunked_gated_delta_rule(*(x[:, :, :30] for x in qkvgb), state, chunk_size=16),
        triton_gated_delta.chunked_gated_delta_rule(*(x[:, :, 30:43] for x in qkvgb), state, chunk_size=16),
        triton_gated_delta.recurrent_gated_delta_rule(*(x[:, :, 43:44] for x in qkvgb), state),
        triton_gated_delta.recurrent_gated_delta_rule(*(x[:, :, 44:] for x in qkvgb), state),
    ]
    torch.testing.assert_close(torch.cat(pieces, dim=2).cpu(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.cpu(), expected_state, atol=1e-4, rtol=1e-4)


def test_a_state_that_does_not_fit_is_refused() -> None:
    *qkvgb, state = _inputs(1, 2, 4, 16, 16, seed=0)
    with pytest.raises(ValueError, match="state"):
        triton_gated_delta.chunked_gated_delta_rule(*qkvgb, state[:, :, :8])
    with pytest.raises(ValueError, match="chunk_size"):
        triton_gated_delta.chunked_gated_delta_rule(*qkvgb, state, chunk_size=24)
