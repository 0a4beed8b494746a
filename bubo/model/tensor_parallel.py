"""Tensor parallelism: a loaded `Decoder` split across the ranks of a torch.distributed group, each rank
keeping about 1/N of the weights and computing its part of every layer.

`shard_decoder` transforms the model in place; the layers' own modules do the math, unchanged:

- attention: whole heads. q/k/v keep the rows of the rank's query and KV heads (a query head stays with
  its KV head), o_proj the matching input columns; the module's head counts become the local ones, and so
  do the config's, so the caches the model makes hold the local KV heads only.
- Gated DeltaNet: whole key heads with their value heads (grouped or tiled order), the conv channels, the
  per-head gates and norms following; ssm_out keeps the matching input columns.
- dense MLP (and a mixture's shared expert): gate/up keep a range of rows, down the matching columns.
- mixture of experts: whole experts. The router stays whole, so every rank picks the same top-k; a rank
  adds up only its own experts' contributions (zero for the others').
- the embedding and the output head: a range of the vocabulary each.

Each projection that keeps input columns (a row-parallel one: o_proj, down, ssm_out) yields a partial
sum, which `AllReduce` adds up over the group; a mixture's routed experts and shared expert share one
sum. Column ranges of a quantized matrix fall on block boundaries, so its raw blocks are sliced as stored,
never dequantized (`QuantizedLinear` packs its slice for the CPU as it would a file's matrix).

Everything else (norms, rotary, the QSA indexer, hyper-connections, the n-gram embedding) is replicated.
An MTP block is dropped: speculative decoding does not run sharded.
"""

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bubo.gguf.model_config import ModelConfig
from bubo.gguf.quants import block_size, type_size
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DeltaNetMixer
from bubo.model.deltanet import GatedDeltaNet
from bubo.model.layers import MLP
from bubo.model.moe import ExpertMatrices, Experts, QuantizedExpertMatrices, SparseMoE, top_k_routing
from bubo.model.quantized_linear import QuantizedEmbedding, QuantizedLinear, group_rows

__all__ = [
    "SHARDED_REASON",
    "AllReduce",
    "ShardedMoE",
    "TensorParallel",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "check_split",
    "shard_decoder",
    "shard_of",
    "weight_bytes",
]

SHARDED_REASON = "tensor parallel: the sharded layers' all-reduces run in the eager forward"

Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group the model is split over (None: the default group)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None

    def part(self, units: int) -> tuple[int, int]:
        """This rank's contiguous share of `units` (the first ranks take one more where they don't divide)."""
        base, extra = divmod(units, self.world)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def exact_part(self, units: int, what: str) -> tuple[int, int]:
        """`part`, for units that must divide evenly (heads: a query head must find its KV head locally)."""
        if units % self.world:
            raise ValueError(f"{units} {what} can't be split evenly over {self.world} ranks")
        return self.part(units)


_sharded: "weakref.WeakKeyDictionary[Decoder, TensorParallel]" = weakref.WeakKeyDictionary()


def shard_of(model: object) -> TensorParallel | None:
    """How `model` was split (`shard_decoder`), or None for a whole model."""
    return _sharded.get(model) if isinstance(model, Decoder) else None


class AllReduce(nn.Module):
    """A row-parallel projection: its partial product summed over the group."""

    def __init__(self, inner: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x).contiguous()
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """The rows [start, stop) of the embedding; a token outside them looks up zeros, and the sum over the
    group has every token's row."""

    def __init__(self, inner: nn.Module, start: int, stop: int, tp: TensorParallel) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.stop = start, stop
        self.tp = tp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = (tokens >= self.start) & (tokens < self.stop)
        out = self.inner((tokens - self.start).clamp(0, self.stop - self.start - 1))
        out = (out * local[..., None].to(out.dtype)).contiguous()
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelHead(nn.Module):
    """The output head's rows [start, stop) of the vocabulary; every rank gathers the whole logits."""

    def __init__(self, inner: nn.Module, vocab: int, tp: TensorParallel) -> None:
        super().__init__()
        self.inner = inner
        self.vocab = vocab
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.inner(x)
        # all_gather takes equal sizes: each part padded to the largest share, the padding cut after.
        width = -(-self.vocab // self.tp.world)
        padded = F.pad(part, (0, width - part.shape[-1])).contiguous()
        gathered = [torch.empty_like(padded) for _ in range(self.tp.world)]
        dist.all_gather(gathered, padded, group=self.tp.group)
        pieces = []
        for rank, piece in enumerate(gathered):
            start, stop = dataclasses.replace(self.tp, rank=rank).part(self.vocab)
            pieces.append(piece[..., : stop - start])
        return torch.cat(pieces, dim=-1)


class _ExpertProjection(nn.Module):
    """Expert `expert` of a stack as a projection, so that layers.MLP runs an expert's SwiGLU."""

    def __init__(self, stack: Experts, expert: int) -> None:
        super().__init__()
        self.expert = expert
        self.linear = stack.linear  # a bound method: the stack is not registered again under each expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.expert)


class ShardedMoE(nn.Module):
    """A mixture of experts whose experts [first, first + count) are this rank's: the whole router
    picks each token's top-k as SparseMoE does, the rank adds the contributions of those it holds (and its
    part of the shared expert), and the sum over the group is the mixture's output."""

    def __init__(
        self, moe: SparseMoE, gate: Experts, up: Experts, down: Experts, first: int, tp: TensorParallel
    ):
        super().__init__()
        self.router = moe.router
        self.gate, self.up, self.down = gate, up, down
        self.first = first
        self.count = _experts_in(gate)
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.shared_expert = moe.shared_expert
        self.shared_expert_gate = moe.shared_expert_gate
        self.tp = tp
        # A plain list: the stacks are registered once, above, not under every expert.
        self._experts = [
            MLP(_ExpertProjection(gate, e), _ExpertProjection(up, e), _ExpertProjection(down, e))
            for e in range(self.count)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = top_k_routing(self.router(x), self.top_k, self.norm_topk_prob)
        weights = weights.to(x.dtype)
        local = chosen - self.first
        out = torch.zeros_like(x)
        # Ascending expert ids, as SparseMoE sums them.
        for expert in local.unique().tolist():
            if 0 <= expert < self.count:
                tokens, slot = torch.where(local == expert)
                out.index_add_(0, tokens, self._experts[expert](x[tokens]) * weights[tokens, slot, None])
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        dist.all_reduce(out, group=self.tp.group)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"experts={self.first}..{self.first + self.count - 1}, top_k={self.top_k}"


def check_split(config: ModelConfig, world: int) -> None:
    """ValueError unless the heads of the model `config` describes divide over `world` ranks (checked from
    the file's header, before any rank loads; a cut through a quantization block shows only at load)."""
    counts = [(config.num_kv_heads, "KV heads")]
    if config.deltanet is not None:
        counts.append((config.deltanet.num_k_heads, "DeltaNet key heads"))
    for units, what in counts:
        TensorParallel(0, world).exact_part(units, what)


def shard_decoder(model: Decoder, tp: TensorParallel, device: torch.device | str | None = None) -> Decoder:
    """Split `model` (whole, as loaded) in place for rank `tp.rank` of `tp.world`, its weights moved to
    `device` (default: where they are); returns it. Raises ValueError when a split would cut a head or a
    quantization block (heads that don't divide over the ranks, say; `check_split` sees the first kind from
    the config alone): the model is then part split, to be loaded again."""
    device = model.device if device is None else torch.device(device)
    config = model.config
    for layer in model.layers:
        mixer = layer.attention
        if isinstance(mixer, DeltaNetMixer):
            _shard_deltanet(mixer.deltanet, tp, device)
        else:
            _shard_attention(getattr(mixer, "attention", mixer), tp, device)
        layer.mlp = _shard_mlp(layer.mlp, tp, device, reduce=True)
    vocab = config.vocab_size
    start, stop = tp.part(vocab)
    model.embedding = VocabParallelEmbedding(
        _embedding_rows(model.embedding, start, stop, model.dtype, device), start, stop, tp
    )
    model.output = VocabParallelHead(_rows(model.output, [(start, stop)], device), vocab, tp)
    model.mtp = None
    _move_replicated(model, device)
    d = config.deltanet
    # The caches the model makes (Decoder.new_cache) read the KV head count from here.
    model.config = dataclasses.replace(
        config,
        num_heads=config.num_heads // tp.world,
        num_kv_heads=config.num_kv_heads // tp.world,
        deltanet=None
        if d is None
        else dataclasses.replace(
            d, num_k_heads=d.num_k_heads // tp.world, num_v_heads=d.num_v_heads // tp.world
        ),
    )
    _warm_up(model)
    _sharded[model] = tp
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors `model` holds as parameters and buffers (quantized ones as their blocks), each
    counted once where modules share one (a tied head)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _shard_attention(attention: Attention, tp: TensorParallel, device: torch.device) -> None:
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    kv_first, kv_stop = tp.exact_part(kv_heads, "KV heads")
    group = heads // kv_heads
    q_rows = (2 if attention.output_gate else 1) * head_dim  # per head: its query (and its gate)
    attention.q_proj = _rows(
        attention.q_proj, [(kv_first * group * q_rows, kv_stop * group * q_rows)], device
    )
    kv = [(kv_first * head_dim, kv_stop * head_dim)]
    attention.k_proj = _rows(attention.k_proj, kv, device)
    attention.v_proj = _rows(attention.v_proj, kv, device)
    group_rows(attention.q_proj, attention.k_proj, attention.v_proj)
    columns = [(kv_first * group * head_dim, kv_stop * group * head_dim)]
    attention.o_proj = AllReduce(_columns(attention.o_proj, columns, device, tp), tp)
    attention.num_heads = (kv_stop - kv_first) * group
    attention.num_kv_heads = kv_stop - kv_first


def _value_heads(net: GatedDeltaNet, first: int, stop: int) -> Ranges:
    """The value heads of key heads [first, stop), in the order a net of those key heads reads them: a
    grouped file's value head j belongs to key head j // ρ, a tiled one's to j % Hk (deltanet.py)."""
    rho = net.num_v_heads // net.num_k_heads
    if net.value_head_order == "grouped":
        return [(first * rho, stop * rho)]
    return [(m * net.num_k_heads + first, m * net.num_k_heads + stop) for m in range(rho)]


def _scaled(ranges: Ranges, size: int, offset: int = 0) -> Ranges:
    return [(offset + a * size, offset + b * size) for a, b in ranges]


def _shard_deltanet(net: GatedDeltaNet, tp: TensorParallel, device: torch.device) -> None:
    hk, hv, dk, dv = net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim
    first, stop = tp.exact_part(hk, "DeltaNet key heads")
    values = _value_heads(net, first, stop)
    keys = [(first, stop)]
    channels = _scaled(keys, dk) + _scaled(keys, dk, hk * dk) + _scaled(values, dv, 2 * hk * dk)
    if net.ssm_in is not None:
        # qwen3next's fused projection: per key head its q, k, ρ v and ρ z rows together.
        net.ssm_in = _rows(net.ssm_in, _scaled(keys, 2 * dk + 2 * (hv // hk) * dv), device)
    else:
        net.attn_qkv = _rows(net.attn_qkv, channels, device)
        net.attn_gate = _rows(net.attn_gate, _scaled(values, dv), device)
    if net.ssm_ba is not None:
        net.ssm_ba = _rows(
            net.ssm_ba, _scaled(keys, 2 * (hv // hk)), device
        )  # per key head ρ betas, ρ alphas
    else:
        net.ssm_beta = _rows(net.ssm_beta, values, device)
        net.ssm_alpha = _rows(net.ssm_alpha, values, device)
    net.conv_weight = _parameter(net.conv_weight, channels, device)
    net.ssm_a = _parameter(net.ssm_a, values, device)
    net.ssm_dt = _parameter(net.ssm_dt, values, device)
    net.ssm_out = AllReduce(_columns(net.ssm_out, _scaled(values, dv), device, tp), tp)
    net.num_k_heads, net.num_v_heads = stop - first, sum(b - a for a, b in values)
    net.conv_channels = sum(b - a for a, b in channels)


def _shard_mlp(mlp: nn.Module, tp: TensorParallel, device: torch.device, reduce: bool) -> nn.Module:
    """A dense MLP's share of the intermediate columns (summed over the group when `reduce`; a mixture
    sums its shared expert with its routed experts), or a mixture's share of the experts."""
    if isinstance(mlp, SparseMoE):
        first, stop = tp.part(_experts_in(mlp.gate))
        shared = mlp.shared_expert
        if shared is not None:
            mlp.shared_expert = _shard_mlp(shared, tp, device, reduce=False)
        gate, up, down = (_expert_range(s, first, stop, device) for s in (mlp.gate, mlp.up, mlp.down))
        return ShardedMoE(mlp, gate, up, down, first, tp)
    assert isinstance(mlp, MLP)
    # Whole blocks of down's input columns: the intermediate width is split in units of its block.
    unit = _block_columns(mlp.down)
    first, stop = tp.part(_in_features(mlp.down) // unit)
    ranges = [(first * unit, stop * unit)]
    gate, up = _rows(mlp.gate, ranges, device), _rows(mlp.up, ranges, device)
    group_rows(gate, up)
    down = _columns(mlp.down, ranges, device, tp)
    return MLP(gate=gate, up=up, down=AllReduce(down, tp) if reduce else down)


def _experts_in(stack: Experts) -> int:
    return (stack.raw if isinstance(stack, QuantizedExpertMatrices) else stack.weight).shape[0]


def _expert_range(stack: Experts, first: int, stop: int, device: torch.device) -> Experts:
    if isinstance(stack, QuantizedExpertMatrices):
        return QuantizedExpertMatrices(stack.raw[first:stop].to(device), stack.ggml_type, stack.in_features)
    assert isinstance(stack, ExpertMatrices)
    return ExpertMatrices(stack.weight[first:stop].to(device))


def _cat(t: torch.Tensor, ranges: Ranges, dim: int) -> torch.Tensor:
    """The slices `ranges` of `t` along `dim`, joined; one range is a view (no copy)."""
    if len(ranges) == 1:
        return t.narrow(dim, ranges[0][0], ranges[0][1] - ranges[0][0])
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _parameter(p: torch.Tensor, ranges: Ranges, device: torch.device) -> nn.Parameter:
    return nn.Parameter(_cat(p, ranges, 0).to(device), requires_grad=False)


def _rows(linear: nn.Module, ranges: Ranges, device: torch.device) -> nn.Module:
    """A projection with only the output rows `ranges` of `linear` (nn.Linear or QuantizedLinear)."""
    if isinstance(linear, QuantizedLinear):
        bias = None if linear.bias is None else _cat(linear.bias, ranges, 0).to(device)
        raw = _cat(linear.raw, ranges, 0).to(device)
        return QuantizedLinear(raw, linear.ggml_type, linear.in_features, bias)
    assert isinstance(linear, nn.Linear), f"can't split {type(linear).__name__}"
    weight = _cat(linear.weight, ranges, 0).to(device)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(_cat(linear.bias, ranges, 0).to(device), requires_grad=False)
    return out


def _columns(linear: nn.Module, ranges: Ranges, device: torch.device, tp: TensorParallel) -> nn.Module:
    """A projection with only the input columns `ranges` of `linear`: a partial product, to be summed over
    the group (rank 0 alone keeps the bias, which the sum must count once)."""
    keep_bias = tp.rank == 0 and linear.bias is not None
    if isinstance(linear, QuantizedLinear):
        size, nbytes = block_size(linear.ggml_type), type_size(linear.ggml_type)
        for a, b in ranges:
            if a % size or b % size:
                raise ValueError(
                    f"columns {a}..{b} of a {linear.ggml_type.name} matrix cut its blocks of {size}: "
                    "this split needs another number of ranks"
                )
        # One range stays a (strided) view of the blocks: on the CPU, of the file's memory map, which the
        # products read with its row stride; a copy to another device is laid out densely.
        raw = _cat(linear.raw, [(a // size * nbytes, b // size * nbytes) for a, b in ranges], 1)
        bias = linear.bias.to(device) if keep_bias else None
        in_features = sum(b - a for a, b in ranges)
        return QuantizedLinear(raw.to(device), linear.ggml_type, in_features, bias)
    assert isinstance(linear, nn.Linear), f"can't split {type(linear).__name__}"
    weight = _cat(linear.weight, ranges, 1).contiguous().to(device)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=keep_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if keep_bias:
        out.bias = nn.Parameter(linear.bias.to(device), requires_grad=False)
    return out


def _block_columns(linear: nn.Module) -> int:
    return block_size(linear.ggml_type) if isinstance(linear, QuantizedLinear) else 1


def _in_features(linear: nn.Module) -> int:
    return linear.in_features  # nn.Linear and QuantizedLinear alike


def _embedding_rows(
    embedding: nn.Module, start: int, stop: int, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    if isinstance(embedding, QuantizedEmbedding):
        raw = embedding.raw[start:stop].to(device)
        return QuantizedEmbedding(raw, embedding.ggml_type, embedding.embedding_dim, dtype)
    assert isinstance(embedding, nn.Embedding)
    return nn.Embedding.from_pretrained(embedding.weight[start:stop].to(device), freeze=True)


def _move_replicated(model: Decoder, device: torch.device) -> None:
    """The weights every rank keeps whole, on `device`: quantized matrices rebuilt from their blocks there
    (a CPU-packed copy would stay behind with `Module.to`), and on the CPU packed now where the whole model
    was loaded without packing (`quantized_linear.packing_deferred`); the rest moved."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear) and (child.raw.device != device or child.packed is None):
                bias = None if child.bias is None else child.bias.to(device)
                raw = child.raw.to(device)
                setattr(parent, name, QuantizedLinear(raw, child.ggml_type, child.in_features, bias))
    model.to(device)


def _warm_up(model: Decoder) -> None:
    """Compile the new shapes' packed products now, as the Decoder does at load."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedExpertMatrices):
            module.warm_up(model.dtype)
        elif isinstance(module, Attention):
            for projection in (module.k_proj, module.v_proj):
                if isinstance(projection, QuantizedLinear):
                    projection.warm_up(model.dtype, alone=True)
