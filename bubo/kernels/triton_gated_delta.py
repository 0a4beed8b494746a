"""The gated delta rule of Gated DeltaNet (bubo/model/deltanet.py) in Triton: the recurrent form for
decode and the chunked form for prefill. `recurrent_gated_delta_rule` and `chunked_gated_delta_rule`
take and return what deltanet.py's torch functions of those names do (their references), state
updated in place; `fused_recurrent_step` is a decode step that also does GatedDeltaNet's prologue
(q/k norms, key head per value head, the gates) in the same kernel.

Recurrent: one program per (sequence, value head, slice of dv) keeps its [dk, BV] part of the state
in registers across the tokens; nothing but q, k, v, g, beta (or their raw forms) and the state is
read or written.

Chunked (Yang et al., "Gated Delta Networks", the WY/UT form deltanet.py describes): within a chunk
of C tokens from state S0, the written values δ solve the unit lower-triangular system
(I + A) δ = βv − β e^γ K S0 with A_ij = β_i (k_i·k_j) e^{γ_i−γ_j} (j < i). A first kernel, parallel
over every chunk, inverts I + A by forward substitution and keeps u = (I+A)⁻¹ βv and
w = (I+A)⁻¹ β e^γ K, so that δ = u − w S0; a second one walks the chunks in order per (sequence,
value head, slice of dv), the only sequential part: a few C×dk×dv products per chunk, its slice of
the state kept in memory and worked on a few dk rows at a time.

Every product runs in float32 ("ieee"), as the torch reference does: the state carries the whole
sequence, so rounding it to TF32 would drift over a long prompt.

Importing this module imports triton; callers import it lazily (bubo/kernels/triton_support.py).
"""

import torch
import triton
import triton.language as tl

__all__ = ["chunked_gated_delta_rule", "fused_recurrent_step", "recurrent_gated_delta_rule"]

# dv columns of the state per program. 32 of 128 gives a decode step of the flagship's 48 value heads
# 192 programs at batch 1, enough to occupy an H100's 132 SMs.
STATE_COLUMNS = 32
# Tokens per chunk.
CHUNK = 64
# Columns of dk (and dv) a chunk kernel reads and multiplies at a time. An exact float32 tl.dot runs on
# FMA units with each thread holding whole rows of its operands along the reduced side: reduced over
# all 128 of dk, the [C, dk] tiles spilled kilobytes per thread (sm_90, tests/kernels/compile_for_cuda.py).
CHUNK_COLUMNS = 16
# dv columns of the state per program of the chunk recurrence: at C = 64 its [C, C] · [C, BV] product
# also reduces over 64, and spilled at 32 columns.
CHUNK_STATE_COLUMNS = 16
CHUNK_WARPS = 8
# The chunk recurrence's warps at C = 16: its [16, 16] tiles leave 8 warps a value or two per thread,
# and ptxas then spilled a few bytes.
SHORT_CHUNK_WARPS = 4
# tl.dot's smallest operand side on NVIDIA GPUs.
MIN_DOT = 16


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and time strides of a [B, H, T, ...] tensor."""
    return x.stride(0), x.stride(1), x.stride(2)


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,  # g, or with RAW_GATES the pre-activation a
    beta_ptr,  # beta, or with RAW_GATES the pre-activation b
    decay_ptr,  # RAW_GATES: [H] ssm_a (= -exp(A_log))
    bias_ptr,  # RAW_GATES: [H] ssm_dt, added to a
    state_ptr,  # [B, H, K, V] float32, contiguous
    out_ptr,  # float32
    qk_sb,
    qk_sh,
    qk_st,
    v_sb,
    v_sh,
    v_st,
    g_sb,
    g_sh,
    g_st,
    o_sb,
    o_sh,
    o_st,
    length,
    num_heads,
    num_key_heads,
    scale,
    eps,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    TILED: tl.constexpr,
    RAW_GATES: tl.constexpr,
):
    seq_head = tl.program_id(0)
    seq, head = seq_head // num_heads, seq_head % num_heads
    # The key head of this value head: j % Hk in the tiled order, j // (Hv / Hk) in the grouped one.
    key_head = head % num_key_heads if TILED else head // (num_heads // num_key_heads)
    dk = tl.arange(0, BK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    dk_ok, dv_ok = dk < K, dv < V
    state_offsets = seq_head * K * V + dk[:, None] * V + dv[None, :]
    state_ok = dk_ok[:, None] & dv_ok[None, :]
    s = tl.load(state_ptr + state_offsets, mask=state_ok, other=0.0)
    qk_base = seq * qk_sb + key_head * qk_sh
    v_base = seq * v_sb + head * v_sh
    g_base = seq * g_sb + head * g_sh
    o_base = seq * o_sb + head * o_sh
    for t in range(length):
        k = tl.load(k_ptr + qk_base + t * qk_st + dk, mask=dk_ok, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + qk_base + t * qk_st + dk, mask=dk_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_base + t * v_st + dv, mask=dv_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_base + t * g_st).to(tl.float32)
        beta = tl.load(beta_ptr + g_base + t * g_st).to(tl.float32)
        if RAW_GATES:
            # GatedDeltaNet's own prologue: l2-normed q (scaled) and k, g = ssm_a softplus(a + dt)
            # (torch's softplus, linear above 20), beta = sigmoid(b).
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
            shifted = g + tl.load(bias_ptr + head).to(tl.float32)
            softplus = tl.where(shifted > 20.0, shifted, tl.log(1.0 + tl.exp(tl.minimum(shifted, 20.0))))
            g = tl.load(decay_ptr + head).to(tl.float32) * softplus
            beta = tl.sigmoid(beta)
        s = s * tl.exp(g)
        # Only what the memory does not already recall for k is written (the delta rule).
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + o_base + t * o_st + dv, out, mask=dv_ok)
    tl.store(state_ptr + state_offsets, s, mask=state_ok)


@triton.jit
def _chunk_prepare_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    u_ptr,  # [B, H, chunks * C, V] float32
    w_ptr,  # [B, H, chunks * C, K] float32
    gamma_ptr,  # [B, H, chunks * C] float32
    qk_sb,
    qk_sh,
    qk_st,
    v_sb,
    v_sh,
    v_st,
    g_sb,
    g_sh,
    g_st,
    length,
    num_heads,
    padded_length,
    K: tl.constexpr,
    V: tl.constexpr,
    BC: tl.constexpr,
    C: tl.constexpr,
):
    seq_head = tl.program_id(0)
    seq, head = (seq_head // num_heads).to(tl.int64), seq_head % num_heads
    rows = tl.arange(0, C)
    columns = tl.arange(0, BC)
    pos = tl.program_id(1) * C + rows
    pos_ok = pos < length
    k_base = seq * qk_sb + head * qk_sh
    v_base = seq * v_sb + head * v_sh
    # Positions past the end load as k = v = 0, g = beta = 0: they write nothing and decay nothing.
    g = tl.load(g_ptr + seq * g_sb + head * g_sh + pos * g_st, mask=pos_ok, other=0.0)
    beta = tl.load(beta_ptr + seq * g_sb + head * g_sh + pos * g_st, mask=pos_ok, other=0.0)
    gamma = tl.cumsum(g, 0)

    # k and v are read BC columns at a time, so that no [C, K] tile is live in registers.
    a = tl.zeros([C, C], dtype=tl.float32)
    for first in range(0, K, BC):
        dk = first + columns
        k = tl.load(
            k_ptr + k_base + pos[:, None] * qk_st + dk[None, :],
            mask=pos_ok[:, None] & (dk < K)[None, :],
            other=0.0,
        )
        a += tl.dot(k * beta[:, None], tl.trans(k), input_precision="ieee")
    below = rows[:, None] > rows[None, :]
    # The upper triangle is masked before exp, where γ_i − γ_j > 0 could overflow.
    a = a * tl.exp(tl.where(below, gamma[:, None] - gamma[None, :], float("-inf")))

    # (I + A)⁻¹ row by row: row i is e_i − Σ_{j<i} A_ij row_j, rows j < i being final already. Row 0
    # and the rows past the end (A's row is zero there) are those of the identity.
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, tl.minimum(C, length - tl.program_id(1) * C)):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
        row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
        inverse = tl.where(rows[:, None] == i, row[None, :], inverse)

    # int64: batch × heads × positions × width passes 2³¹ on a long batched prompt.
    out_rows = seq_head.to(tl.int64) * padded_length + pos
    for first in range(0, V, BC):
        dv = first + columns
        dv_ok = dv < V
        v = tl.load(
            v_ptr + v_base + pos[:, None] * v_st + dv[None, :],
            mask=pos_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        u = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
        tl.store(u_ptr + out_rows[:, None] * V + dv[None, :], u, mask=dv_ok[None, :])
    for first in range(0, K, BC):
        dk = first + columns
        dk_ok = dk < K
        k = tl.load(
            k_ptr + k_base + pos[:, None] * qk_st + dk[None, :],
            mask=pos_ok[:, None] & dk_ok[None, :],
            other=0.0,
        )
        w = tl.dot(inverse, k * beta[:, None] * tl.exp(gamma)[:, None], input_precision="ieee")
        tl.store(w_ptr + out_rows[:, None] * K + dk[None, :], w, mask=dk_ok[None, :])
    tl.store(gamma_ptr + out_rows, gamma)


@triton.jit
def _chunk_recurrence_kernel(
    q_ptr,
    k_ptr,
    u_ptr,
    w_ptr,
    gamma_ptr,
    state_ptr,  # [B, H, K, V] float32, contiguous
    out_ptr,  # [B, H, chunks * C, V] float32
    qk_sb,
    qk_sh,
    qk_st,
    length,
    num_heads,
    padded_length,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
):
    seq_head = tl.program_id(0)
    seq, head = (seq_head // num_heads).to(tl.int64), seq_head % num_heads
    rows = tl.arange(0, C)
    columns = tl.arange(0, BK)
    dv = tl.program_id(1) * BV + tl.arange(0, BV)
    dv_ok = dv < V
    # int64: batch × heads × positions × width passes 2³¹ on a long batched prompt.
    state_base = seq_head.to(tl.int64) * K * V
    scratch_base = seq_head.to(tl.int64) * padded_length
    causal = rows[:, None] >= rows[None, :]
    qk_base = seq * qk_sb + head * qk_sh
    # The [K, BV] state stays in memory (L1/L2) and is worked on BK rows at a time: held whole in
    # registers next to the chunk's tiles it spilled.
    for start in range(0, length, C):
        pos = start + rows
        pos_ok = pos < length
        scratch_rows = scratch_base + pos
        u = tl.load(u_ptr + scratch_rows[:, None] * V + dv[None, :], mask=dv_ok[None, :], other=0.0)
        gamma = tl.load(gamma_ptr + scratch_rows)
        gamma_end = tl.sum(tl.where(rows == C - 1, gamma, 0.0), 0)

        recalled = tl.zeros([C, BV], dtype=tl.float32)  # w S0
        read = tl.zeros([C, BV], dtype=tl.float32)  # q S0
        scores = tl.zeros([C, C], dtype=tl.float32)  # q kᵀ
        for first in range(0, K, BK):
            dk = first + columns
            dk_ok = dk < K
            qk_ok = pos_ok[:, None] & dk_ok[None, :]
            s = tl.load(
                state_ptr + state_base + dk[:, None] * V + dv[None, :],
                mask=dk_ok[:, None] & dv_ok[None, :],
                other=0.0,
            )
            q = tl.load(q_ptr + qk_base + pos[:, None] * qk_st + dk[None, :], mask=qk_ok, other=0.0)
            k = tl.load(k_ptr + qk_base + pos[:, None] * qk_st + dk[None, :], mask=qk_ok, other=0.0)
            w = tl.load(w_ptr + scratch_rows[:, None] * K + dk[None, :], mask=dk_ok[None, :], other=0.0)
            recalled += tl.dot(w, s, input_precision="ieee")
            read += tl.dot(q, s, input_precision="ieee")
            scores += tl.dot(q, tl.trans(k), input_precision="ieee")

        delta = u - recalled
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
        out = read * tl.exp(gamma)[:, None] + tl.dot(scores * decay, delta, input_precision="ieee")
        tl.store(
            out_ptr + scratch_rows[:, None] * V + dv[None, :], out, mask=pos_ok[:, None] & dv_ok[None, :]
        )

        # Every thread has read S0 before any writes S1; each block is read whole before it is written.
        tl.debug_barrier()
        for first in range(0, K, BK):
            dk = first + columns
            dk_ok = dk < K
            state_offsets = state_base + dk[:, None] * V + dv[None, :]
            state_ok = dk_ok[:, None] & dv_ok[None, :]
            s = tl.load(state_ptr + state_offsets, mask=state_ok, other=0.0)
            k = tl.load(
                k_ptr + qk_base + pos[:, None] * qk_st + dk[None, :],
                mask=pos_ok[:, None] & dk_ok[None, :],
                other=0.0,
            )
            k_end = k * tl.exp(gamma_end - gamma)[:, None]
            s = s * tl.exp(gamma_end) + tl.dot(tl.trans(k_end), delta, input_precision="ieee")
            tl.debug_barrier()
            tl.store(state_ptr + state_offsets, s, mask=state_ok)
        tl.debug_barrier()


def _checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The inputs in the layout the kernels index: float32, unit stride along the feature dims."""
    if q.shape != k.shape or v.shape[:3] != k.shape[:3] or g.shape != k.shape[:3] or beta.shape != g.shape:
        raise ValueError(
            f"mismatched shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"g {tuple(g.shape)} beta {tuple(beta.shape)}"
        )
    if state.shape != (k.shape[0], k.shape[1], k.shape[3], v.shape[3]) or state.dtype != torch.float32:
        raise ValueError(f"state {tuple(state.shape)} {state.dtype} does not fit q/k/v")
    q, k, v = (x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in (q, k, v))
    g, beta = g.float(), beta.float()
    if g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule one token at a time; arguments and result as deltanet.py's
    `recurrent_gated_delta_rule`: q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T], state
    [B, H, dk, dv] float32 updated in place. Returns o [B, H, T, dv] float32."""
    q, k, v, g, beta = _checked(q, k, v, g, beta, state)
    batch, heads, length, _ = k.shape
    out = torch.empty(batch, heads, length, v.shape[-1], dtype=torch.float32, device=v.device)
    _launch_recurrent(
        (q, k, v, g, beta, g, g, state, out),  # g again where ssm_a / ssm_dt go: unread without raw gates
        (*_strides(q), *_strides(v), *g.stride(), *_strides(out)),
        length,
        heads,
        heads,
        tiled=False,
        raw_gates=False,
    )
    return out


def fused_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_a: torch.Tensor,
    ssm_dt: torch.Tensor,
    state: torch.Tensor,
    *,
    tiled: bool,
    eps: float,
) -> torch.Tensor:
    """GatedDeltaNet's decode step from the conv output on, but the output norm, in one kernel: q, k
    [B, T, Hk, dk] l2-normed (q also scaled by 1/sqrt(dk), `eps` inside the root), each value head
    reading its key head in the `tiled` (j % Hk) or grouped (j // (Hv/Hk)) order, g = ssm_a ·
    softplus(a + ssm_dt) and beta = sigmoid(b) from a, b [B, T, Hv], then the delta rule over v
    [B, T, Hv, dv] from `state` [B, Hv, dk, dv] float32 (updated in place). Returns o [B, T, Hv, dv]
    float32. Saves the dozen small kernels those steps take in torch, per layer and token."""
    batch, length, key_heads, _ = k.shape
    heads, dv = v.shape[2], v.shape[3]
    if q.shape != k.shape or heads % key_heads or a.shape != (batch, length, heads) or b.shape != a.shape:
        raise ValueError(
            f"mismatched shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"a {tuple(a.shape)} b {tuple(b.shape)}"
        )
    if state.shape != (batch, heads, k.shape[3], dv) or state.dtype != torch.float32:
        raise ValueError(f"state {tuple(state.shape)} {state.dtype} does not fit q/k/v")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    if a.stride() != b.stride():
        a, b = a.contiguous(), b.contiguous()
    out = torch.empty(batch, length, heads, dv, dtype=torch.float32, device=v.device)

    def strides(x: torch.Tensor) -> tuple[int, int, int]:  # batch, head, time
        return x.stride(0), x.stride(2), x.stride(1)

    _launch_recurrent(
        (q, k, v, a, b, ssm_a, ssm_dt, state, out),
        (*strides(q), *strides(v), a.stride(0), a.stride(2), a.stride(1), *strides(out)),
        length,
        heads,
        key_heads,
        tiled=tiled,
        raw_gates=True,
        scale=k.shape[3] ** -0.5,
        eps=eps,
    )
    return out


def _launch_recurrent(
    tensors: tuple[torch.Tensor, ...],
    strides: tuple[int, ...],
    length: int,
    heads: int,
    key_heads: int,
    *,
    tiled: bool,
    raw_gates: bool,
    scale: float = 1.0,
    eps: float = 0.0,
) -> None:
    """Run `_recurrent_kernel` on (q, k, v, g|a, beta|b, ssm_a, ssm_dt, state, out), the state worked
    on in a contiguous copy if it is not contiguous itself."""
    *inputs, state, out = tensors
    dk, dv = state.shape[2], state.shape[3]
    work = state if state.is_contiguous() else state.contiguous()
    block_v = min(STATE_COLUMNS, triton.next_power_of_2(dv))
    _recurrent_kernel[(state.shape[0] * heads, triton.cdiv(dv, block_v))](
        *inputs,
        work,
        out,
        *strides,
        length,
        heads,
        key_heads,
        scale,
        eps,
        K=dk,
        V=dv,
        BK=triton.next_power_of_2(dk),
        BV=block_v,
        TILED=tiled,
        RAW_GATES=raw_gates,
    )
    if work is not state:
        state.copy_(work)


def recurrence_warps(chunk_size: int) -> int:
    """Warps of `_chunk_recurrence_kernel` at chunks of `chunk_size` tokens."""
    return SHORT_CHUNK_WARPS if chunk_size <= MIN_DOT else CHUNK_WARPS


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The same recurrence a chunk of `chunk_size` tokens at a time (a power of two of at least 16;
    default 64, or the smallest that holds a shorter input, so a few tokens of speculative decoding
    don't pay for 64); arguments and result as `recurrent_gated_delta_rule` (and deltanet.py's
    `chunked_gated_delta_rule`)."""
    if chunk_size is None:
        chunk_size = min(CHUNK, max(MIN_DOT, triton.next_power_of_2(k.shape[2])))
    if chunk_size < MIN_DOT or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two of at least {MIN_DOT}, not {chunk_size}")
    q, k, v, g, beta = _checked(q, k, v, g, beta, state)
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    chunks = triton.cdiv(length, chunk_size)
    padded = chunks * chunk_size
    scratch = dict(dtype=torch.float32, device=v.device)
    u = torch.empty(batch, heads, padded, dv, **scratch)
    w = torch.empty(batch, heads, padded, dk, **scratch)
    gamma = torch.empty(batch, heads, padded, **scratch)
    _chunk_prepare_kernel[(batch * heads, chunks)](
        k,
        v,
        g,
        beta,
        u,
        w,
        gamma,
        *_strides(k),
        *_strides(v),
        *g.stride(),
        length,
        heads,
        padded,
        K=dk,
        V=dv,
        BC=CHUNK_COLUMNS,
        C=chunk_size,
        num_warps=CHUNK_WARPS,
    )
    work = state if state.is_contiguous() else state.contiguous()
    out = torch.empty(batch, heads, padded, dv, **scratch)
    _chunk_recurrence_kernel[(batch * heads, triton.cdiv(dv, CHUNK_STATE_COLUMNS))](
        q,
        k,
        u,
        w,
        gamma,
        work,
        out,
        *_strides(k),
        length,
        heads,
        padded,
        K=dk,
        V=dv,
        BK=CHUNK_COLUMNS,
        BV=CHUNK_STATE_COLUMNS,
        C=chunk_size,
        num_warps=recurrence_warps(chunk_size),
    )
    if work is not state:
        state.copy_(work)
    return out[:, :, :length]
