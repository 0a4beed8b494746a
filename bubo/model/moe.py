"""Sparse mixture-of-experts feed-forward (Qwen3-MoE), its experts held as the GGUF file holds them.

The formula is transformers' Qwen3MoeSparseMoeBlock (Qwen3MoeTopKRouter, then Qwen3MoeExperts),
which llama.cpp's qwen3moe graph (build_moe_ffn: softmax gating, SiLU, normalised weights) matches:

    p      = softmax(x R^T)                      router R [num_experts, hidden], in float32
    (w, e) = the top-k of p;  w = w / sum(w)     the latter when norm_topk_prob
    y      = sum_j w_j * down_ej(silu(gate_ej(x)) * up_ej(x))

Each of gate/up/down is one 3-D tensor [num_experts, out, in] (llama.cpp's ffn_gate_exps,
ffn_up_exps, ffn_down_exps). A quantized one stays raw blocks [num_experts, out, row_bytes], and
each forward dequantizes only the experts some token was routed to: per decoded token that is
top-k of them (8 of 128 in Qwen3-30B-A3B), which is the point of a sparse model.

Qwen3-Next and Qwen3.5-MoE add a shared expert every token goes through, scaled by a learned scalar
gate (Qwen3_5MoeSparseMoeBlock / Qwen3NextSparseMoeBlock; llama.cpp's ffn_*_shexp tensors):

    y += sigmoid(g · x) * down_s(silu(gate_s(x)) * up_s(x))      g: ffn_gate_inp_shexp [1, hidden]

On CUDA, quantized experts (with triton installed, BUBO_TRITON not 0) go through the fused Triton
kernel of bubo/kernels/triton_moe.py instead of the per-expert loop below.
"""

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from bubo.gguf.quants import dequantize
from bubo.kernels.triton_support import TRITON_TYPES, triton_enabled
from bubo.model.quantized_linear import gemm_operand, scratch_buffer

__all__ = ["ExpertMatrices", "Experts", "QuantizedExpertMatrices", "SparseMoE"]


class ExpertMatrices(nn.Module):
    """Float expert weights [num_experts, out_features, in_features]; `linear(x, e)` is x W_e^T."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.weight[expert])

    def extra_repr(self) -> str:
        return "experts={}, out_features={}, in_features={}".format(*self.weight.shape)


class QuantizedExpertMatrices(nn.Module):
    """Expert weights kept as ggml blocks (uint8 [num_experts, out_features, row_bytes]); `linear(x, e)`
    dequantizes expert e alone into the thread's scratch buffer (see quantized_linear) and applies it."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, in_features: int) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.in_features = in_features

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        rows = self.raw.shape[1]
        operand = gemm_operand(x)
        buffer = scratch_buffer(rows * self.in_features, operand.dtype, self.raw.device)
        weight = dequantize(
            self.raw[expert], self.ggml_type, operand.dtype, out=buffer.view(rows, self.in_features)
        )
        return F.linear(operand, weight).to(x.dtype)

    def extra_repr(self) -> str:
        experts, rows, _ = self.raw.shape
        return f"experts={experts}, out_features={rows}, in_features={self.in_features}, type={self.ggml_type.name}"


# What a `WeightSource` hands out for one expert stack: float or quantized, the same `linear`.
Experts = ExpertMatrices | QuantizedExpertMatrices


class SparseMoE(nn.Module):
    """x [..., hidden] -> the routed experts' SwiGLU outputs, weighted by the router (formula above)."""

    def __init__(
        self,
        router: nn.Module,
        gate: Experts,
        up: Experts,
        down: Experts,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("a shared expert needs its gate, and a gate its expert")
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.router = router
        self.gate = gate
        self.up = up
        self.down = down
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # float32 softmax whatever the compute dtype, as Qwen3MoeTopKRouter: in half precision
        # close router scores would round together and change which experts are picked.
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, top_k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        if self._fused(x):
            # Imported here: triton is optional, and present only where CUDA is.
            from bubo.kernels.triton_moe import fused_moe

            out = fused_moe(x, weights, chosen, self.gate, self.up, self.down)
        else:
            out = self._expert_loop(x, weights, chosen)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the experts run in the fused Triton kernel (all three quantized, types it reads, CUDA)."""
        stacks = (self.gate, self.up, self.down)
        return all(
            isinstance(s, QuantizedExpertMatrices) and s.ggml_type in TRITON_TYPES for s in stacks
        ) and triton_enabled(x.device)

    def _expert_loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Tokens grouped by expert, so each active expert's weights are used (and, quantized,
        # dequantized) once for all its tokens. unique() is sorted: experts are summed in the
        # order transformers sums them.
        for expert in chosen.unique().tolist():
            tokens, slot = torch.where(chosen == expert)
            h = x[tokens]
            y = self.down.linear(F.silu(self.gate.linear(h, expert)) * self.up.linear(h, expert), expert)
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
