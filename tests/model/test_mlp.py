"""The SwiGLU MLP's in-place inference path against plain float math, and its autograd path."""

import torch
from torch import nn

from bubo.model.layers import MLP


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))


def test_inference_matches_the_reference() -> None:
    mlp = _mlp()
    x = torch.randn(3, 5, 8)
    x64 = x.double()
    gate = x64 @ mlp.gate.weight.double().T
    up = x64 @ mlp.up.weight.double().T
    expected = (gate / (1 + torch.exp(-gate)) * up) @ mlp.down.weight.double().T
    with torch.inference_mode():
        out = mlp(x)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_gradients_flow_where_autograd_records() -> None:
    mlp = _mlp()
    x = torch.randn(2, 8, requires_grad=True)
    mlp(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
