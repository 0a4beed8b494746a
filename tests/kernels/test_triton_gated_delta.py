"""The Triton gated delta rule (recurrent step, fused decode step, chunked prefill) against
deltanet.py's torch recurrence, from a non-zero state, on ragged lengths that end mid-chunk. On the
CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

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


@pytest.mark.parametrize(("order", "length"), [("tiled", 1), ("grouped", 1), ("grouped", 3)])
def test_fused_step_matches_norms_gates_and_the_torch_recurrence(order: str, length: int) -> None:
    """The fused decode step (l2 norms, key head per value head, gates from the raw projections) against
    those steps in torch followed by deltanet.py's recurrence. Hk = 2 key heads, Hv = 6 value heads."""
    batch, key_heads, heads, dk, dv, eps = 2, 2, 6, 16, 32, 1e-6
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(batch, length, key_heads, dk, generator=gen)
    k = torch.randn(batch, length, key_heads, dk, generator=gen)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    a = torch.randn(batch, length, heads, generator=gen) * 4  # some past softplus' linear threshold
    a[0, 0, 0] = 30.0
    b = torch.randn(batch, length, heads, generator=gen)
    ssm_a = -torch.rand(heads, generator=gen) - 0.5
    ssm_dt = torch.randn(heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen) * 0.3

    def per_value_head(x: torch.Tensor) -> torch.Tensor:  # [B, T, Hk, d] -> [B, Hv, T, d]
        x = x.transpose(1, 2)
        rho = heads // key_heads
        return x.repeat(1, rho, 1, 1) if order == "tiled" else x.repeat_interleave(rho, dim=1)

    qn = per_value_head(q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * dk**-0.5)
    kn = per_value_head(k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps))
    g = (ssm_a * F.softplus(a + ssm_dt)).transpose(1, 2)
    beta = torch.sigmoid(b).transpose(1, 2)
    expected_state = state.clone()
    expected = deltanet.recurrent_gated_delta_rule(qn, kn, v.transpose(1, 2), g, beta, expected_state)

    got_state = state.to(DEVICE)
    got = triton_gated_delta.fused_recurrent_step(
        *(x.to(DEVICE) for x in (q, k, v, a, b, ssm_a, ssm_dt)),
        got_state,
        tiled=order == "tiled",
        eps=eps,
    )
    torch.testing.assert_close(got.cpu(), expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.cpu(), expected_state, atol=1e-5, rtol=1e-5)


def test_a_state_that_does_not_fit_is_refused() -> None:
    *qkvgb, state = _inputs(1, 2, 4, 16, 16, seed=0)
    with pytest.raises(ValueError, match="state"):
        triton_gated_delta.chunked_gated_delta_rule(*qkvgb, state[:, :, :8])
    with pytest.raises(ValueError, match="chunk_size"):
        triton_gated_delta.chunked_gated_delta_rule(*qkvgb, state, chunk_size=24)
