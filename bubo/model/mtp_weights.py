"""The MTP block from a Hugging Face checkpoint (`--mtp-weights PATH`), for GGUF files whose converter
dropped it.

Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / Qwen3.8-Flash-Next (qwen4exp) checkpoints keep the block under
`mtp.*`; the GGUF file of the same model then has no `nextn` layer (llama.cpp's converter leaves it out
unless asked). Only the block's own tensors are read from the file given (a shard of the checkpoint is
enough); the embedding and output head are the main model's, as in the GGUF case. The names map onto
the GGUF names the decoder builds the block from (`build_mtp`), as llama.cpp's converter would write
them:

    mtp.fc                          -> nextn.eh_proj   ([hidden, 2·hidden], the embedding half first)
    mtp.pre_fc_norm_embedding       -> nextn.enorm     mtp.pre_fc_norm_hidden -> nextn.hnorm
    mtp.norm                        -> nextn.shared_head_norm
    mtp.layers.0.*                  -> the layer's attention / MLP or MoE tensors at blk.{n}

qwen4exp's block (bubo/model/hyper_connected_mtp.py) differs: `mtp.fc_embedding` and `mtp.fc_hidden`
([hidden, hidden] each) are put side by side into nextn.eh_proj, embedding first, as the converter
does; `mtp.pre_fc_norm_hidden` is [hc·hidden]; the layer carries hyper-connections
(`attn_hyper_connection.*` / `mlp_hyper_connection.*` -> hc_attn_* / hc_ffn_*) and a QSA indexer
(`self_attn.indexer.index_qk_proj` split into indexer.q_proj, the query heads, and indexer.k_proj);
`mtp.hyper_connection_mixer.*` is the block's own stream mixer (nextn.hc_head_*; its
`block_inject_weight`, unused by a final mixer, is dropped as vLLM drops it); an optional
`mtp.shared_head.head` is a head of the block's own (nextn.shared_head_head).

The checkpoint's RMSNorms are zero-centred (they multiply by 1 + w): like the converter, the + 1 is
folded in here. Experts come per expert (`experts.{e}.gate_proj`) or fused as transformers 5 holds
them (`experts.gate_up_proj` [E, 2F, H], gate rows first; `experts.down_proj` [E, H, F]). Tensors are
kept plain in the compute dtype: the block is small next to the model.
"""

from collections.abc import Mapping
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError, safe_open
from torch import nn

from bubo.gguf.model_config import ModelConfig
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import build_mtp
from bubo.model.moe import ExpertMatrices

__all__ = ["MTPWeightsError", "check_mtp_file", "load_mtp_weights"]

SUPPORTED = ("qwen35", "qwen35moe", "qwen3next", "qwen4exp")
PREFIX = "mtp."

# GGUF name (after `blk.{n}.`) -> checkpoint name (after `mtp.`)
_NAMES = {
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
    "attn_norm.weight": "layers.0.input_layernorm.weight",
    "post_attention_norm.weight": "layers.0.post_attention_layernorm.weight",
    "attn_q.weight": "layers.0.self_attn.q_proj.weight",
    "attn_k.weight": "layers.0.self_attn.k_proj.weight",
    "attn_v.weight": "layers.0.self_attn.v_proj.weight",
    "attn_output.weight": "layers.0.self_attn.o_proj.weight",
    "attn_q_norm.weight": "layers.0.self_attn.q_norm.weight",
    "attn_k_norm.weight": "layers.0.self_attn.k_norm.weight",
    "ffn_gate.weight": "layers.0.mlp.gate_proj.weight",
    "ffn_up.weight": "layers.0.mlp.up_proj.weight",
    "ffn_down.weight": "layers.0.mlp.down_proj.weight",
    "ffn_gate_inp.weight": "layers.0.mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "layers.0.mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "layers.0.mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "layers.0.mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "layers.0.mlp.shared_expert.down_proj.weight",
}
# qwen4exp's block: the attention and MoE names above, less the norms its hyper-connections replace.
_HYPER_CONNECTED_NAMES = {
    name: source
    for name, source in _NAMES.items()
    if not name.startswith(
        ("nextn.", "attn_norm", "post_attention_norm", "ffn_gate.", "ffn_up.", "ffn_down.")
    )
} | {
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "indexer.q_norm.weight": "layers.0.self_attn.indexer.q_layernorm.weight",
    "indexer.k_norm.weight": "layers.0.self_attn.indexer.k_layernorm.weight",
    "nextn.hc_head_norm.weight": "hyper_connection_mixer.hc_norm.weight",
    "nextn.hc_head_down.weight": "hyper_connection_mixer.input_mix_weight_down.weight",
    "nextn.hc_head_up.weight": "hyper_connection_mixer.input_mix_weight_up.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
}
for _gguf, _hf in (("hc_attn", "attn_hyper_connection"), ("hc_ffn", "mlp_hyper_connection")):
    _HYPER_CONNECTED_NAMES |= {
        f"{_gguf}_norm.weight": f"layers.0.{_hf}.hc_norm.weight",
        f"{_gguf}_down.weight": f"layers.0.{_hf}.input_mix_weight_down.weight",
        f"{_gguf}_up.weight": f"layers.0.{_hf}.input_mix_weight_up.weight",
        f"{_gguf}_inject.weight": f"layers.0.{_hf}.block_inject_weight.weight",
    }
# Read but not needed: a final mixer writes nothing back into the streams.
_HYPER_CONNECTED_UNUSED = ("hyper_connection_mixer.block_inject_weight.weight",)
_FC_HALVES = ("fc_embedding.weight", "fc_hidden.weight")
_INDEX_QK = "layers.0.self_attn.indexer.index_qk_proj.weight"

_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_FUSED_EXPERTS = "layers.0.mlp.experts."


class MTPWeightsError(ValueError):
    """The file can't provide this model's MTP block (its one-line message says why)."""


class CheckpointMTPWeights:
    """A WeightSource (bubo/model/decoder_layer.py) over a checkpoint's `mtp.*` tensors, asked by GGUF name
    (`names`: GGUF name after `blk.{layer}.` -> checkpoint name after `mtp.`)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        layer: int,
        dtype: torch.dtype,
        device: torch.device,
        names: Mapping[str, str] = _NAMES,
    ):
        self.tensors = tensors  # checkpoint names without the `mtp.` prefix
        self.prefix = f"blk.{layer}."
        self.dtype, self.device = dtype, device
        self.names = names
        self.used: set[str] = set()

    def _local(self, name: str) -> str:
        if not name.startswith(self.prefix):
            raise MTPWeightsError(f"the MTP block asked for {name}, which is not one of its tensors")
        return name.removeprefix(self.prefix)

    def _get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        local = self._local(name)
        source = self.names.get(local)
        if source is None or source not in self.tensors:
            raise MTPWeightsError(f"no {PREFIX}{source or local} tensor for the MTP block's {local}")
        tensor = self._checked(source, shape)
        if local.endswith("norm.weight"):
            tensor = tensor.float() + 1  # zero-centred in the checkpoint
        return tensor.to(self.dtype).to(self.device)

    def _checked(self, source: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.tensors[source]
        if tuple(tensor.shape) != shape:
            raise MTPWeightsError(
                f"{PREFIX}{source} has shape {tuple(tensor.shape)}, this model's MTP block needs {shape}"
            )
        self.used.add(source)
        return tensor

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._get(name, shape)

    def has(self, name: str) -> bool:
        return self.names.get(self._local(name)) in self.tensors

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        if bias is not None:
            raise MTPWeightsError(f"the MTP block asked for a bias ({bias}): Qwen MTP layers have none")
        return self._plain_linear(self._get(name, shape))

    def _plain_linear(self, weight: torch.Tensor) -> nn.Module:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight.to(self.dtype).to(self.device), requires_grad=False)
        return layer

    def embedding(self, name: str, shape: tuple[int, int]) -> nn.Module:
        raise MTPWeightsError(f"the MTP block shares the model's embedding; it asked for {name}")

    def experts(self, name: str, shape: tuple[int, int, int]) -> ExpertMatrices:
        local = self._local(name)
        kind = _EXPERTS.get(local)
        if kind is None:
            raise MTPWeightsError(f"the MTP block asked for unknown experts {local}")
        count = shape[0]
        per_expert = [f"{_FUSED_EXPERTS}{e}.{kind}.weight" for e in range(count)]
        if all(n in self.tensors for n in per_expert):
            stack = torch.stack([self.tensors[n] for n in per_expert])
            self.used.update(per_expert)
            source = f"{_FUSED_EXPERTS}{{0..{count - 1}}}.{kind}.weight"
        else:
            fused = _FUSED_EXPERTS + ("down_proj" if kind == "down_proj" else "gate_up_proj")
            if fused not in self.tensors:
                raise MTPWeightsError(
                    f"no {PREFIX}{per_expert[0]} (per expert) or {PREFIX}{fused} (fused) tensor"
                )
            stack, source = self.tensors[fused], fused
            self.used.add(fused)
            if kind != "down_proj":
                half = stack.shape[1] // 2
                stack = stack[:, :half] if kind == "gate_proj" else stack[:, half:]
        if tuple(stack.shape) != shape:
            raise MTPWeightsError(
                f"{PREFIX}{source} gives {kind} experts of shape {tuple(stack.shape)}, this model needs {shape}"
            )
        return ExpertMatrices(stack.contiguous().to(self.dtype).to(self.device))

    def table(self, name: str, dim: int) -> tuple[torch.Tensor, GGMLQuantizationType | None]:
        raise MTPWeightsError(f"the MTP block has no lookup tables; it asked for {name}")


class HyperConnectedCheckpointMTPWeights(CheckpointMTPWeights):
    """qwen4exp's block from its checkpoint: the two fc halves joined into eh_proj, the indexer's
    fused projection split, and the mixer's unused inject weight dropped."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__(tensors, config.num_layers, dtype, device, _HYPER_CONNECTED_NAMES)
        self.used.update(n for n in _HYPER_CONNECTED_UNUSED if n in tensors)
        indexer = config.indexer
        assert indexer is not None  # config_from_gguf sets it for qwen4exp
        self.query_rows = indexer.num_heads * indexer.head_dim
        self.index_qk_shape = (self.query_rows + indexer.head_dim, config.hidden_size)

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        local = self._local(name)
        if local == "nextn.eh_proj.weight":
            hidden = shape[0]
            halves = []
            for source in _FC_HALVES:
                if source not in self.tensors:
                    raise MTPWeightsError(f"no {PREFIX}{source} tensor for the MTP block's {local}")
                halves.append(self._checked(source, (hidden, hidden)))
            return self._plain_linear(torch.cat(halves, dim=1))
        if local in ("indexer.q_proj.weight", "indexer.k_proj.weight"):
            # transformers' fused indexer projection: the query heads' rows, then the key head's
            if _INDEX_QK not in self.tensors:
                raise MTPWeightsError(f"no {PREFIX}{_INDEX_QK} tensor for the MTP block's {local}")
            fused = self._checked(_INDEX_QK, self.index_qk_shape)
            rows = fused[: self.query_rows] if local == "indexer.q_proj.weight" else fused[self.query_rows :]
            return self._plain_linear(rows)
        return super().linear(name, shape, bias)


def check_mtp_file(config: ModelConfig, path: str | Path) -> None:
    """What can be checked before the model loads: the architecture, and that `path` is a readable
    safetensors file holding one MTP layer's `mtp.*` tensors (their shapes are checked by the load)."""
    if config.architecture not in SUPPORTED:
        raise MTPWeightsError(f"--mtp-weights: not supported for {config.architecture} (it has no MTP block)")
    if config.mtp_layers:
        raise MTPWeightsError("--mtp-weights: the GGUF file already holds an MTP block (its nextn layer)")
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = f.keys()
    except (OSError, SafetensorError) as error:  # missing file, not a safetensors file
        raise MTPWeightsError(f"--mtp-weights: can't read {path}: {error}") from error
    names = [n.removeprefix(PREFIX) for n in stored if n.startswith(PREFIX)]
    if not names:
        raise MTPWeightsError(f"--mtp-weights: {path} holds no {PREFIX}* tensors")
    if any(name.startswith("layers.") and not name.startswith("layers.0.") for name in names):
        raise MTPWeightsError(f"--mtp-weights: {path} holds more than one MTP layer; Bubo runs one")


def load_mtp_weights(model: Decoder, path: str | Path) -> None:
    """Give `model` the MTP block stored under `mtp.*` in the safetensors file `path`; MTPWeightsError
    when the file lacks it, holds tensors of other shapes or names the model doesn't use."""
    config = model.config
    check_mtp_file(config, path)
    if model.mtp is not None:
        raise MTPWeightsError("--mtp-weights: the model already has an MTP block")
    with safe_open(str(path), framework="pt") as f:
        stored = f.keys()
        # A shard of the checkpoint is enough: only the block's tensors are read.
        tensors = {n.removeprefix(PREFIX): f.get_tensor(n) for n in stored if n.startswith(PREFIX)}
    source = (
        HyperConnectedCheckpointMTPWeights(tensors, config, model.dtype, model.device)
        if config.hc_count
        else CheckpointMTPWeights(tensors, config.num_layers, model.dtype, model.device)
    )
    try:
        mtp = build_mtp(config, source)
    except MTPWeightsError as error:
        raise MTPWeightsError(f"--mtp-weights {path}: {error}") from None
    unused = sorted(set(tensors) - source.used)
    if unused:
        raise MTPWeightsError(
            f"--mtp-weights {path}: {PREFIX}{unused[0]} (and {len(unused) - 1} more) don't fit this model's "
            "MTP block"
        )
    model.mtp = mtp
