"""Gated DeltaNet: the linear-attention token mixer of the hybrid Qwen models (qwen3next, qwen35,
qwen35moe, qwen4exp), built from its tensors as the GGUF file holds them.

The formula is transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet (which llama.cpp's
qwen3next / qwen35 graphs reproduce); per token, with value head j and its key head κ(j):

    qkv = attn_qkv x;  z = attn_gate x;  b = ssm_beta x;  a = ssm_alpha x    (or b, a from ssm_ba)
    c   = silu(causal depthwise conv over time of qkv, kernel ssm_conv1d [channels, K])
    q, k, v = split(c);  q = l2norm(q) / sqrt(dk);  k = l2norm(k)             (per key head)
    g   = ssm_a * softplus(a + ssm_dt.bias);  beta = sigmoid(b)                (ssm_a = -exp(A_log))
    S_j = exp(g_j) S_j;  S_j += k δᵀ with δ = beta_j (v_j - S_jᵀ k);  o_j = S_jᵀ q (k, q of κ(j))
    y   = ssm_out concat_j( rmsnorm(o_j) * ssm_norm * act(z_j) )              (act: silu; sigmoid in qwen4exp)

The state S [Hv, dk, dv] (float32) and the last K-1 pre-conv qkv vectors are all a sequence
carries between calls, so a prompt can be fed in pieces and then decoded one token at a time.

Value-head order. HF checkpoints store value heads grouped by key head (value head j uses key head
j // ρ, ρ = Hv/Hk). llama.cpp's converter keeps that order for qwen3next but rewrites it for
qwen35 / qwen35moe / qwen4exp into a tiled order (value head j uses key head j % Hk), moving every
value-head axis of every tensor together (convert_hf_to_gguf.py, _LinearAttentionVReorderBase).
The mixer is told which one its tensors use (`value_head_order`); only the key-to-value head
mapping depends on it, since the per-head math is the same.
"""

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from bubo.kernels.triton_support import triton_enabled
from bubo.model.state import DeltaNetState

__all__ = ["GatedDeltaNet", "chunked_gated_delta_rule", "recurrent_gated_delta_rule"]

ValueHeadOrder = Literal["grouped", "tiled"]
GateActivation = Literal["silu", "sigmoid"]

# transformers' l2norm (torch_chunk_gated_delta_rule, use_qk_l2norm_in_kernel) hard-codes this;
# llama.cpp passes rms_norm_eps instead, the same 1e-6 in every released config.
L2NORM_EPS = 1e-6
# transformers' chunk length; it only trades the size of the intra-chunk matrices against the
# number of sequential steps, the result is the same recurrence.
CHUNK_SIZE = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule one token at a time (transformers' torch_recurrent_gated_delta_rule).

    q, k [B, Hv, T, dk] (q already normalised and scaled), v [B, Hv, T, dv], g and beta [B, Hv, T],
    all float32; `state` [B, Hv, dk, dv] is updated in place. Returns o [B, Hv, T, dv].
    """
    out = torch.empty_like(v)
    s = state
    for t in range(v.shape[2]):
        k_t = k[:, :, t]
        s = s * g[:, :, t].exp()[..., None, None]
        # What the memory already recalls for k_t; only the difference to v_t is written (delta rule).
        recalled = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v[:, :, t] - recalled) * beta[:, :, t, None]
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, t])
    state.copy_(s)
    return out


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The same recurrence as `recurrent_gated_delta_rule`, computed a chunk of tokens at a time.

    Same arguments and result. Follows the WY/UT formulation of transformers'
    torch_chunk_gated_delta_rule (Yang et al., "Gated Delta Networks"). Inside a chunk starting
    from state S0, with γ_i the cumulative log decay up to position i, the written values obey

        δ_i = β_i (v_i - e^{γ_i} S0ᵀ k_i - Σ_{j<i} e^{γ_i-γ_j} (k_i·k_j) δ_j)

    a unit lower-triangular system (I + A) δ = β v - β e^γ K S0, solved once per chunk for both
    right-hand sides so that only a few matmuls per chunk depend on S0 (the sequential part).
    """
    batch, heads, length, _ = k.shape
    dv = v.shape[-1]
    # Zero-padding the tail is exact: a padded step has k = v = q = 0, beta = 0 and g = 0 (decay 1),
    # so it writes nothing and leaves the state as it is.
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, chunk_size) for x in (g, beta))

    gamma = g.cumsum(-1)
    # decay[i, j] = e^{γ_i - γ_j} for j <= i; the upper triangle is masked before exp, where the
    # difference is positive and could overflow.
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    # A below the diagonal; its diagonal and (zero) upper triangle are ignored by the unitriangular solve.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    keys_s0 = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    # Causal attention inside the chunk, j <= i (the diagonal included: o_i reads S_i, written by δ_i).
    intra = (q @ k.transpose(-1, -2)) * decay
    q_s0 = q * gamma.exp().unsqueeze(-1)
    # Each key's contribution to the chunk-end state, decayed from its own position to the end.
    k_end = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    out = torch.empty(batch, heads, chunks, chunk_size, dv, dtype=v.dtype, device=v.device)
    s = state
    for n in range(chunks):
        delta = values[:, :, n] - keys_s0[:, :, n] @ s
        out[:, :, n] = q_s0[:, :, n] @ s + intra[:, :, n] @ delta
        s = s * chunk_decay[:, :, n] + k_end[:, :, n].transpose(-1, -2) @ delta
    state.copy_(s)
    return out.reshape(batch, heads, chunks * chunk_size, dv)[:, :, :length]


class GatedDeltaNet(nn.Module):
    """x [B, T, hidden] -> [B, T, hidden], continuing each sequence from `state` (updated in place).

    Tensors in GGUF names, torch-shaped (GGUF ne reversed); projections are any module applying
    x Wᵀ (nn.Linear, QuantizedLinear):
        attn_qkv   [2·Hk·dk + Hv·dv, hidden]   rows: all q heads, all k heads, all v heads
        attn_gate  [Hv·dv, hidden]             z, the output gate; or, in qwen3next files from
        ssm_in     [Hk·(2dk + 2ρ·dv), hidden]  llama.cpp's first Qwen3Next converter, Hugging Face's
                                               fused in_proj_qkvz as is: per key head q, k, its ρ v
                                               heads, its ρ z heads (ρ = Hv / Hk)
        ssm_beta, ssm_alpha [Hv, hidden]       qwen35 family; or
        ssm_ba     [2·Hv, hidden]              qwen3next: per key head, ρ beta rows then ρ alpha rows
        ssm_conv1d [2·Hk·dk + Hv·dv, K]        depthwise kernel, tap K-1 = current token
        ssm_a      [Hv]                        -exp(A_log), already negated by the converter
        ssm_dt     [Hv]                        the bias added to alpha (GGUF `ssm_dt.bias`)
        ssm_norm   [dv]                        gated-norm gamma, shared by all heads, no +1 folded
        ssm_out    [hidden, Hv·dv]
    Sizes from GGUF metadata: Hk = ssm.group_count, Hv = ssm.time_step_rank, dk = ssm.state_size,
    dv = ssm.inner_size / Hv. `value_head_order`: "grouped" for qwen3next files, "tiled" for
    qwen35 / qwen35moe / qwen4exp (module docstring). `norm_eps`: rms_norm_eps.
    `gate_activation`: silu (transformers' Qwen3Next/Qwen3_5 RMSNormGated); qwen4exp uses sigmoid.
    """

    def __init__(
        self,
        attn_qkv: nn.Module | None,
        attn_gate: nn.Module | None,
        ssm_conv1d: torch.Tensor,
        ssm_a: torch.Tensor,
        ssm_dt: torch.Tensor,
        ssm_norm: torch.Tensor,
        ssm_out: nn.Module,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        value_head_order: ValueHeadOrder,
        norm_eps: float,
        ssm_beta: nn.Module | None = None,
        ssm_alpha: nn.Module | None = None,
        ssm_ba: nn.Module | None = None,
        ssm_in: nn.Module | None = None,
        gate_activation: GateActivation = "silu",
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        super().__init__()
        if (ssm_ba is None) == (ssm_beta is None or ssm_alpha is None):
            raise ValueError("give either ssm_ba, or ssm_beta and ssm_alpha")
        if (ssm_in is None) == (attn_qkv is None or attn_gate is None):
            raise ValueError("give either ssm_in, or attn_qkv and attn_gate")
        if num_v_heads % num_k_heads:
            raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_channels = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        if ssm_conv1d.shape[0] != self.conv_channels:
            raise ValueError(f"ssm_conv1d has {ssm_conv1d.shape[0]} channels, expected {self.conv_channels}")
        self.conv_kernel = ssm_conv1d.shape[1]
        self.value_head_order = value_head_order
        self.norm_eps = norm_eps
        self.gate_activation = gate_activation
        self.chunk_size = chunk_size

        self.attn_qkv, self.attn_gate, self.ssm_in, self.ssm_out = attn_qkv, attn_gate, ssm_in, ssm_out
        self.ssm_beta, self.ssm_alpha, self.ssm_ba = ssm_beta, ssm_alpha, ssm_ba
        self.conv_weight = nn.Parameter(ssm_conv1d, requires_grad=False)
        self.ssm_a = nn.Parameter(ssm_a, requires_grad=False)
        self.ssm_dt = nn.Parameter(ssm_dt, requires_grad=False)
        self.ssm_norm = nn.Parameter(ssm_norm, requires_grad=False)

    def new_state(
        self, batch: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> DeltaNetState:
        """An empty state for `batch` sequences; `dtype` is the activation dtype of the conv history."""
        return DeltaNetState.zeros(
            batch,
            self.conv_channels,
            self.conv_kernel,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        return self.forward_keeping(x, state, ())[0]

    def forward_keeping(
        self, x: torch.Tensor, state: DeltaNetState, cuts: Sequence[int]
    ) -> tuple[torch.Tensor, list[DeltaNetState]]:
        """`forward`, and copies of the state after the first c tokens for each c in `cuts` (ascending,
        0 < c < T): what the prompt cache keeps at turn ends and speculative decoding rolls back to.
        Projections and the convolution run once over all T tokens; only the delta rule, a sequential
        recurrence anyway, runs piece by piece between the cuts."""
        batch, length, _ = x.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim

        # Projections (transformers: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, or the fused
        # qkvz / ba of Qwen3Next).
        qkv, z = self._qkv_z(x)
        b, a = self._beta_alpha(x)

        # Causal depthwise conv over time (transformers' causal_conv1d_fn / causal_conv1d_update):
        # the stored K-1 previous inputs stand in front of this call's, so a prompt fed in pieces
        # convolves exactly as a whole one. The K taps are summed directly: at these shapes that is
        # cheaper than a depthwise F.conv1d.
        window = torch.cat([state.conv_state, qkv.transpose(1, 2).to(state.conv_state.dtype)], dim=-1)
        # After c tokens the conv history is the K-1 window entries ending at token c-1.
        history = self.conv_kernel - 1
        conv_at = [window[:, :, c : c + history].clone() for c in cuts]
        state.conv_state.copy_(window[:, :, length:])
        window = window.to(self.conv_weight.dtype)
        conv = self.conv_weight[:, 0, None] * window[:, :, :length]
        for tap in range(1, self.conv_kernel):
            conv = conv + self.conv_weight[:, tap, None] * window[:, :, tap : tap + length]
        mixed = F.silu(conv).transpose(1, 2).to(x.dtype)

        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = q.reshape(batch, length, hk, dk)
        k = k.reshape(batch, length, hk, dk)
        v = v.reshape(batch, length, hv, dv)
        if length == 1 and triton_enabled(x.device):
            # A decode step on CUDA: the norms, the gates and the recurrence in one kernel.
            from bubo.kernels.triton_gated_delta import fused_recurrent_step

            o = fused_recurrent_step(
                q,
                k,
                v,
                a,
                b,
                self.ssm_a,
                self.ssm_dt,
                state.recurrent_state,
                tiled=self.value_head_order == "tiled",
                eps=L2NORM_EPS,
            )
            kept = []
        else:
            o, kept = self._delta_rule_pieces(q, k, v, a, b, state.recurrent_state, cuts, conv_at)

        # Gated RMSNorm per head (Qwen3_5RMSNormGated): gamma is used as stored (no +1), the gate in fp32.
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        gate = F.silu(z.float()) if self.gate_activation == "silu" else torch.sigmoid(z.float())
        y = (self.ssm_norm * normed.to(x.dtype)) * gate
        return self.ssm_out(y.to(x.dtype).reshape(batch, length, hv * dv)), kept

    def _delta_rule_pieces(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        state: torch.Tensor,
        cuts: Sequence[int],
        conv_at: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[DeltaNetState]]:
        """q, k [B, T, Hk, dk], v [B, T, Hv, dv] and the pre-activation a, b [B, T, Hv] through the
        norms, gates and delta rule, continuing `state`: o [B, T, Hv, dv] float32, and the states after
        each of `cuts` tokens (with `conv_at`, their conv histories)."""
        length = v.shape[1]
        dk = k.shape[-1]
        # Heads first, float32 from here to the norm, as transformers' delta-rule kernels compute.
        q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
        q = _l2norm(q) * dk**-0.5
        k = _l2norm(k)
        q, k = self._keys_per_value_head(q), self._keys_per_value_head(k)

        # Per-head log decay g <= 0 and write strength beta (Qwen3_5GatedDeltaNet.forward).
        g = self.ssm_a.float() * F.softplus(a.float() + self.ssm_dt.float())
        beta = torch.sigmoid(b.float())
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)

        pieces, kept, begin = [], [], 0
        for end in [*cuts, length]:
            piece = slice(begin, end)
            pieces.append(
                self._delta_rule(
                    q[:, :, piece], k[:, :, piece], v[:, :, piece], g[:, :, piece], beta[:, :, piece], state
                )
            )
            if end < length:
                kept.append(DeltaNetState(conv_at[len(kept)], state.clone()))
            begin = end
        return torch.cat(pieces, dim=2).transpose(1, 2), kept

    def _delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> torch.Tensor:
        # One decode token needs no intra-chunk matrices; anything longer is a prefill.
        if triton_enabled(v.device):
            from bubo.kernels import triton_gated_delta as kernels

            if v.shape[2] == 1:
                return kernels.recurrent_gated_delta_rule(q, k, v, g, beta, state)
            # The kernel's own chunk length (any length gives the same recurrence).
            return kernels.chunked_gated_delta_rule(q, k, v, g, beta, state)
        if v.shape[2] == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return chunked_gated_delta_rule(q, k, v, g, beta, state, self.chunk_size)

    def _qkv_z(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [B, T, conv channels] (all q heads, all k heads, all v heads) and z [B, T, Hv, dv]."""
        batch, length, _ = x.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.ssm_in is None:
            assert self.attn_qkv is not None and self.attn_gate is not None
            return self.attn_qkv(x), self.attn_gate(x).view(batch, length, hv, dv)
        # The fused in_proj_qkvz, grouped by key head (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering);
        # the later converter splits it the same way into attn_qkv and attn_gate.
        rho = hv // hk
        fused = self.ssm_in(x).view(batch, length, hk, 2 * dk + 2 * rho * dv)
        q, k, v, z = fused.split([dk, dk, rho * dv, rho * dv], dim=-1)
        qkv = torch.cat([t.reshape(batch, length, -1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(batch, length, hv, dv)

    def _beta_alpha(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, a) [B, T, Hv], the pre-activation beta and alpha, in the value-head order of the tensors."""
        if self.ssm_ba is None:
            assert self.ssm_beta is not None and self.ssm_alpha is not None
            return self.ssm_beta(x), self.ssm_alpha(x)
        # Qwen3Next's in_proj_ba, kept as is by the converter: for each key head, its ρ value heads'
        # beta rows then their alpha rows (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering).
        batch, length, _ = x.shape
        rho = self.num_v_heads // self.num_k_heads
        ba = self.ssm_ba(x).view(batch, length, self.num_k_heads, 2 * rho)
        return ba[..., :rho].reshape(batch, length, -1), ba[..., rho:].reshape(batch, length, -1)

    def _keys_per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hk, T, d] -> [B, Hv, T, d]: value head j's query/key, per `value_head_order`."""
        rho = self.num_v_heads // self.num_k_heads
        if rho == 1:
            return x
        if self.value_head_order == "grouped":
            return x.repeat_interleave(rho, dim=1)  # j -> j // rho, as transformers does
        return x.repeat(1, rho, 1, 1)  # j -> j % Hk, llama.cpp's broadcast for reordered files

    def extra_repr(self) -> str:
        return (
            f"key_heads={self.num_k_heads}, value_heads={self.num_v_heads}, head_k_dim={self.head_k_dim}, "
            f"head_v_dim={self.head_v_dim}, conv_kernel={self.conv_kernel}, "
            f"value_head_order={self.value_head_order}, gate={self.gate_activation}"
        )
