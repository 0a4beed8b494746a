"""`bubo inspect`: a GGUF file's header, the layer plan Bubo would build from it, its metadata and tensors."""

from collections import Counter
from pathlib import Path
from typing import Any

from bubo.gguf.config import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
    check_block_count,
    config_from_gguf,
)
from bubo.gguf.model_config import MlpKind, ModelConfig
from bubo.gguf.reader import GGUFError, GGUFFile

__all__ = ["print_listing"]


def print_listing(path: Path, all_metadata: bool) -> int:
    """What `bubo inspect` prints of the GGUF file at `path`: header, layer plan, metadata (long values
    cut short unless `all_metadata`), every tensor, and the tensors per type."""
    with GGUFFile(path) as f:
        # A broken file is refused in one line, as `bubo serve` refuses it (the listing would walk its
        # layers for as long as its block count says).
        if f.architecture in SUPPORTED_ARCHITECTURES:
            check_block_count(f)
        print(f"file:         {path}")
        print(f"gguf version: {f.version}")
        print(f"architecture: {f.architecture}")
        print(f"tensors:      {len(f.tensors)} ({_human_bytes(sum(t.nbytes for t in f.tensors.values()))})")
        _print_layer_plan(f)
        print("\nmetadata:")
        width = max((len(k) for k in f.metadata), default=0)
        for key, value in f.metadata.items():
            print(f"  {key:<{width}}  {_summarize(value, all_metadata)}")
        print("\ntensors:")
        header = ("name", "type", "shape", "size")
        rows = [
            (t.name, t.ggml_type.name, "x".join(map(str, t.shape)), _human_bytes(t.nbytes))
            for t in f.tensors.values()
        ]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for row in rows:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        print("\ntensor types:")
        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        for t in f.tensors.values():
            counts[t.ggml_type.name] += 1
            sizes[t.ggml_type.name] += t.nbytes
        for name, count in counts.most_common():
            print(f"  {name:<8} {count:>5} tensors  {_human_bytes(sizes[name]):>10}")
    return 0


def _print_layer_plan(f: GGUFFile) -> None:
    # Inspecting is how one finds out why a file won't run, so a file the runtime can't build still
    # gets the rest of the listing: the reason takes the plan's place instead of ending the command.
    try:
        config = config_from_gguf(f)
    except UnsupportedArchitectureError:
        print(f"layer plan:   none: architecture '{f.architecture}' is not supported by the Bubo runtime")
        return
    except GGUFError as error:
        print(f"layer plan:   none: Bubo can't build this model: {error}")
        return
    mlp = _mlp_description(config)
    streams = f", {config.hc_count} hyper-connected residual streams" if config.hc_count else ""
    print(f"layer plan:   {config.num_layers} layers{streams}, mlp: {mlp}")
    rows = [("layers", "mixer", "mlp")]
    rows += [(span, mixer, config.mlp_kind.value) for span, mixer in _mixer_runs(config)]
    width = max(len(r[0]) for r in rows)
    mixer_width = max(len(r[1]) for r in rows)
    for span, mixer, mlp_kind in rows:
        print(f"  {span:<{width}}  {mixer:<{mixer_width}}  {mlp_kind}")
    if config.mtp_layers:
        attention = "gated full attention"
        if config.indexer is not None and any(config.indexer.compress_ratios):
            attention = "hyper-connected QSA attention"
        print(
            f"  + MTP block at blk.{config.num_layers} ({attention}, {config.mlp_kind.value}): "
            "drafts the token after next"
        )


def _mixer_runs(config: ModelConfig) -> list[tuple[str, str]]:
    """(layer span such as "0-2", mixer kind) for each run of consecutive layers of one kind."""
    kinds = [_mixer_kind(config, i) for i in range(config.num_layers)]
    runs: list[tuple[str, str]] = []
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((str(start) if i - 1 == start else f"{start}-{i - 1}", kinds[start]))
            start = i
    return runs


def _mixer_kind(config: ModelConfig, i: int) -> str:
    if not config.is_hybrid:
        return "full attention"
    if config.recurrent_layers[i]:
        kind = "linear attention (Gated DeltaNet)"
        return kind + " + n-gram embedding" if config.ple is not None and config.ple.layer == i else kind
    ratio = config.indexer.compress_ratios[i] if config.indexer is not None else 0
    if ratio:
        return f"indexed sparse attention (QSA, {ratio} tokens/block, budget {config.indexer.budget})"
    if config.indexer is not None:
        # The converter slip of qwen4exp.md §2.3: the file says 0, so this layer runs dense, as in llama.cpp.
        return "gated full attention (QSA off: compress ratio 0)"
    return "gated full attention"


def _mlp_description(config: ModelConfig) -> str:
    if config.mlp_kind == MlpKind.DENSE:
        return f"dense SwiGLU, FFN {config.intermediate_size}"
    text = (
        f"sparse MoE, {config.num_experts} experts, top-{config.num_experts_per_tok}, "
        f"expert FFN {config.moe_intermediate_size}"
    )
    if config.mlp_kind == MlpKind.SPARSE_MOE_SHARED:
        text += f", + sigmoid-gated shared expert FFN {config.shared_expert_intermediate_size}"
    return text


def _summarize(value: Any, whole: bool) -> str:
    if isinstance(value, str):
        return repr(value) if whole or len(value) <= 80 else f"{value[:77]!r}... ({len(value)} chars)"
    if isinstance(value, list):
        if whole or len(value) <= 8:
            return repr(value)
        head = ", ".join(repr(v) for v in value[:4])
        return f"[{head}, ...] ({len(value)} items)"
    return repr(value)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exponent = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"
