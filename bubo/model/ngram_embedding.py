"""PLE of qwen4exp (Qwen3.8-Flash-Next): a per-layer hashed n-gram embedding added to the streams.

On its layer (GGUF `ple.layers`, 0-based), before the attention-side hyper-connection, every token
looks up one row per hash head in a huge table: for each n-gram order o = 2..n, the token and its
o − 1 predecessors are hashed into `heads_per_ngram` heads, each with its own prime-sized slice of
the table. The concatenated rows give one key per residual stream and a shared value; the streams'
agreement with their key gates the value, and a dilated causal depthwise conv adds the gated values
of earlier tokens. Spec section 4.4; transformers' Qwen4ExpTextNGramEmbedding and
Qwen4ExpTextPLELayer.

Hash (spec 4.4, "Context ids" and "Row ids"): c₀ = the token, c_s = the token s places back, but
EOS when the sequence has no such token or an EOS stands between (the s-th predecessor itself
included); for order o, x = (c₀·m₀) xor … xor (c_{o−1}·m_{o−1}) and head h of that order reads
row (x mod size_h) + offset_h. Every product stays below 2⁶³ (m ≤ (2⁶³−1) / vocab), so int64
arithmetic is exact. The multipliers m, sizes and offsets are stored in the GGUF as
`ple.layer_multipliers`, `ple.head_vocab_sizes`, `ple.head_offsets`; `derive_ngram_hash`
recomputes them from the HF config for validation.

Decode state (spec 4.9): the last n − 1 token ids (EOS before the sequence start, which is what
makes a missing predecessor read as EOS) and the last (Kp − 1)·n normalised gated values of the
conv. With them a prompt fed in one call, in pieces or token by token gives the same result.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from bubo.gguf.quants import dequantize
from bubo.model.hyper_connections import grouped_rms_norm
from bubo.model.state import PLEState

__all__ = ["NGramEmbedding", "NGramHash", "PLELayer", "derive_ngram_hash", "ngram_rows"]

# transformers' constants (_build_layer_multipliers, _splitmix64; spec 4.4).
_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007  # each further PLE layer's seed is this much larger
# Floor of |gate| before its square root (Qwen4ExpTextPLELayer.forward).
_GATE_FLOOR = 1e-6


@dataclass(frozen=True, eq=False)
class NGramHash:
    """The hash constants of one PLE layer, as int64 tensors (GGUF uint64 arrays, all below 2⁶³).

    layer_multipliers [n]: m_j for the token j places back. head_offsets / head_vocab_sizes [Nh]:
    where head h's slice of the table starts and how many rows (a prime) it has; heads are ordered
    by n-gram order, `heads_per_ngram` per order, order 2 first.
    """

    layer_multipliers: torch.Tensor
    head_offsets: torch.Tensor
    head_vocab_sizes: torch.Tensor

    @classmethod
    def from_values(
        cls, layer_multipliers: Sequence[int], head_offsets: Sequence[int], head_vocab_sizes: Sequence[int]
    ) -> "NGramHash":
        """From the GGUF arrays `ple.layer_multipliers`, `ple.head_offsets`, `ple.head_vocab_sizes`."""
        if len(head_offsets) != len(head_vocab_sizes) or len(layer_multipliers) < 2:
            raise ValueError(
                f"{len(layer_multipliers)} multipliers, {len(head_offsets)} offsets and "
                f"{len(head_vocab_sizes)} head sizes don't describe an n-gram hash"
            )
        if len(head_offsets) % (len(layer_multipliers) - 1):
            raise ValueError(
                f"{len(head_offsets)} heads can't be split evenly over n-gram orders 2..{len(layer_multipliers)}"
            )
        return cls(
            *(
                torch.tensor(list(v), dtype=torch.int64)
                for v in (layer_multipliers, head_offsets, head_vocab_sizes)
            )
        )

    @property
    def ngram_size(self) -> int:
        return self.layer_multipliers.shape[0]

    @property
    def num_heads(self) -> int:
        return self.head_offsets.shape[0]

    @property
    def heads_per_ngram(self) -> int:
        return self.num_heads // (self.ngram_size - 1)


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return value ^ (value >> 31)


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    return all(value % divisor for divisor in range(2, math.isqrt(value) + 1))


def derive_ngram_hash(
    vocab_size: int,
    ngram_size: int,
    heads_per_ngram: int,
    base: int,
    seed: int,
    divisor: int,
    ple_layer_index: int = 0,
) -> tuple[NGramHash, int]:
    """The hash constants and the padded table row count, from the HF config, as transformers makes them.

    vocab_size, ngram_size, heads_per_ngram, ngram_vocab_size_base (`base`), seed and
    make_ngram_vocab_size_divisible_by (`divisor`) are HF config fields the converter does not
    store (spec 2.3 item 4); `ple_layer_index` is the layer's rank among the PLE layers (0 for the
    real model). Spec 4.4 "Constants".
    """
    # Multipliers: odd, and small enough that id·m never reaches 2⁶³.
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    layer_seed = seed + _LAYER_SEED_STRIDE * ple_layer_index
    multipliers = [
        2 * (_splitmix64((layer_seed + _SPLITMIX_GAMMA * (j + 1)) & _MASK64) % half) + 1
        for j in range(ngram_size)
    ]
    # Head sizes: consecutive primes >= base, the earlier PLE layers' heads taking the first ones.
    num_heads = (ngram_size - 1) * heads_per_ngram
    primes: list[int] = []
    candidate = base - 1
    while len(primes) < (ple_layer_index + 1) * num_heads:
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    sizes = primes[ple_layer_index * num_heads :]
    offsets = [sum(sizes[:h]) for h in range(num_heads)]
    rows = math.ceil(sum(sizes) / divisor) * divisor
    return NGramHash.from_values(multipliers, offsets, sizes), rows


def ngram_rows(
    token_ids: torch.Tensor, history: torch.Tensor, ngram_hash: NGramHash, eos_token_id: int
) -> torch.Tensor:
    """Table rows [B, T, Nh] of the tokens token_ids [B, T], preceded by history [B, n − 1].

    `history` holds each sequence's last n − 1 earlier tokens, oldest first (EOS standing for
    positions before the sequence start). It is not modified.
    """
    n = ngram_hash.ngram_size
    length = token_ids.shape[1]
    tokens = torch.cat([history, token_ids], dim=1).long()
    multipliers = ngram_hash.layer_multipliers.to(tokens.device)
    sizes = ngram_hash.head_vocab_sizes.to(tokens.device)
    offsets = ngram_hash.head_offsets.to(tokens.device)
    per_order = ngram_hash.heads_per_ngram

    mixed = tokens[:, n - 1 :] * multipliers[0]
    cut = torch.zeros_like(token_ids, dtype=torch.bool)
    blocks = []
    for s in range(1, n):
        previous = tokens[:, n - 1 - s : n - 1 - s + length]
        # An EOS among the s nearest predecessors ends the context: this one and all further back read as EOS.
        cut = cut | (previous == eos_token_id)
        context = torch.where(cut, eos_token_id, previous)
        mixed = mixed ^ (context * multipliers[s])
        heads = slice((s - 1) * per_order, s * per_order)  # the heads of order s + 1
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[heads]) + offsets[heads])
    return torch.cat(blocks, dim=-1)


class NGramEmbedding(nn.Module):
    """token_ids [B, T] and history [B, n − 1] -> [B, T, Nh·d_p], the concatenated rows of every hash head.

    `table` is GGUF `per_layer_token_embd.weight`, kept as given (on the CPU a view of the memory
    map; the real one has 51.2 B entries): either a float tensor [rows, d_p], or its raw ggml blocks,
    uint8 [rows, row_bytes], with `table_type`, of which only the looked-up rows are dequantized.
    `dtype` is the compute dtype of the result.
    """

    def __init__(
        self,
        table: torch.Tensor,
        ngram_hash: NGramHash,
        eos_token_id: int,
        *,
        table_type: GGMLQuantizationType | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if table.is_floating_point() == (table_type is not None):
            raise ValueError("give a float table, or a uint8 table of raw blocks with its table_type")
        # A plain attribute, not a buffer: moving the module (`.to(device)`) must not copy a table
        # that may be far larger than the device's memory; it stays where the loader put it.
        self.table = table
        self.table_type = table_type
        self.ngram_hash = ngram_hash
        self.eos_token_id = eos_token_id
        self.dtype = dtype
        last_row = int((ngram_hash.head_offsets + ngram_hash.head_vocab_sizes).max())
        if last_row > table.shape[0]:
            raise ValueError(f"the hash heads reach row {last_row}, the table has {table.shape[0]}")

    def forward(self, token_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        rows = ngram_rows(token_ids, history, self.ngram_hash, self.eos_token_id)
        # The table may stay on the CPU (memory-mapped) while the model runs elsewhere: gather there.
        picked = self.table[rows.to(self.table.device)]
        if self.table_type is not None:
            picked = dequantize(picked, self.table_type, self.dtype)
        return picked.to(device=token_ids.device, dtype=self.dtype).flatten(-2)

    def extra_repr(self) -> str:
        kind = "float" if self.table_type is None else self.table_type.name
        return f"rows={self.table.shape[0]}, heads={self.ngram_hash.num_heads}, table={kind}"


class PLELayer(nn.Module):
    """streams [B, T, hc·hidden], token_ids [B, T] -> the PLE term to add to the streams [B, T, hc·hidden].

    Continues each sequence from `state` (updated in place). Layer N's tensors, torch-shaped (spec 3.4):
        ple_key         [hc·hidden, P]   modules applying x Wᵀ (nn.Linear, QuantizedLinear)
        ple_value       [hidden, P]
        ple_norm_key, ple_norm_query, ple_norm_conv  [hc·hidden]  +1-folded gammas (spec 3.6), grouped by stream
        ple_conv1d      [hc·hidden, Kp]  depthwise kernel, tap Kp − 1 = current token
    `ngram_size` (GGUF `ple.ngram_size`) is also the conv dilation; `hc_count`: `hyper_connection.count`;
    `norm_eps`: `attention.layer_norm_rms_epsilon`.

    Per token (spec 4.4 "Module"): key = norm_key(ple_key e), value = ple_value e; per stream s the
    gate g = (key[s] · norm_query(X)[s]) / sqrt(hidden), softened to sign(g)·sqrt(max(|g|, 1e-6));
    gv[s] = sigmoid(g)·value; the result is gv + silu(dilated conv of norm_conv(gv)).
    """

    def __init__(
        self,
        embedding: NGramEmbedding,
        ple_key: nn.Module,
        ple_value: nn.Module,
        ple_norm_key: torch.Tensor,
        ple_norm_query: torch.Tensor,
        ple_norm_conv: torch.Tensor,
        ple_conv1d: torch.Tensor,
        *,
        hc_count: int,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.ple_key, self.ple_value = ple_key, ple_value
        self.hc_count = hc_count
        self.hidden_size = ple_conv1d.shape[0] // hc_count
        self.norm_eps = norm_eps
        for name, gamma in (("key", ple_norm_key), ("query", ple_norm_query), ("conv", ple_norm_conv)):
            if gamma.shape != (hc_count * self.hidden_size,):
                raise ValueError(
                    f"ple_norm_{name} has shape {tuple(gamma.shape)}, expected ({ple_conv1d.shape[0]},)"
                )
        self.norm_key = nn.Parameter(ple_norm_key, requires_grad=False)
        self.norm_query = nn.Parameter(ple_norm_query, requires_grad=False)
        self.norm_conv = nn.Parameter(ple_norm_conv, requires_grad=False)
        self.conv_weight = nn.Parameter(ple_conv1d, requires_grad=False)
        self.conv_kernel = ple_conv1d.shape[1]
        self.dilation = embedding.ngram_hash.ngram_size
        self.conv_history = (self.conv_kernel - 1) * self.dilation
        # The sigmoid gates pass through this identity so that a forward hook on it (the research
        # trace's ngram_gates site) sees them as computed; without hooks it is a no-op call.
        self.gate_probe = nn.Identity()

    def new_state(
        self, batch: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> PLEState:
        """An empty state for `batch` sequences; `dtype` is the activation dtype of the conv history."""
        context = self.embedding.ngram_hash.ngram_size - 1
        return PLEState(
            tokens=torch.full(
                (batch, context), self.embedding.eos_token_id, dtype=torch.int64, device=device
            ),
            conv_state=torch.zeros(
                batch, self.conv_weight.shape[0], self.conv_history, dtype=dtype, device=device
            ),
            eos_token_id=self.embedding.eos_token_id,
        )

    def _norm(self, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        return grouped_rms_norm(x, gamma, self.hc_count, self.norm_eps)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, state: PLEState) -> torch.Tensor:
        length = token_ids.shape[1]
        emb = self.embedding(token_ids, state.tokens).to(streams.dtype)
        state.tokens.copy_(
            torch.cat([state.tokens, token_ids.to(state.tokens.dtype)], dim=1)[:, -state.tokens.shape[1] :]
        )

        shape = (self.hc_count, self.hidden_size)
        key = self._norm(self.ple_key(emb), self.norm_key).unflatten(-1, shape)
        value = self.ple_value(emb)
        query = self._norm(streams, self.norm_query).unflatten(-1, shape)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden_size)
        # A signed square root: keeps the gate's sign, compresses its range (sign(0) = 0).
        gate = gate.abs().clamp_min(_GATE_FLOOR).sqrt() * gate.sign()
        gated = (self.gate_probe(torch.sigmoid(gate)) * value.unsqueeze(-2)).flatten(-2)
        gated_normed = self._norm(gated, self.norm_conv)

        # Causal depthwise conv with dilation n over the normed gated values: tap k of position t reads
        # position t − (Kp − 1 − k)·n. The stored (Kp − 1)·n earlier values stand in front of this
        # call's (zeros before the sequence start, transformers' left padding), so in the window tap
        # k of position t sits at index t + k·n.
        window = torch.cat(
            [state.conv_state, gated_normed.transpose(1, 2).to(state.conv_state.dtype)], dim=-1
        )
        state.conv_state.copy_(window[:, :, length:])
        window = window.to(self.conv_weight.dtype)
        conv = self.conv_weight[:, 0, None] * window[:, :, :length]
        for tap in range(1, self.conv_kernel):
            start = tap * self.dilation
            conv = conv + self.conv_weight[:, tap, None] * window[:, :, start : start + length]
        return gated + F.silu(conv).transpose(1, 2).to(streams.dtype)

    def extra_repr(self) -> str:
        return (
            f"streams={self.hc_count}, hidden={self.hidden_size}, conv_kernel={self.conv_kernel}, "
            f"dilation={self.dilation}, eps={self.norm_eps}"
        )
