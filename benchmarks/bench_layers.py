"""Qwen3.8-Flash-Next's layers at their real width: decode time per layer kind, weight bytes read per
token, the fraction of the device's memory bandwidth that achieves, and prefill tokens/s.

Builds a few layers of each kind with the real shapes (shared/spec/qwen4exp.md sections 1 and 3):
Gated DeltaNet, QSA indexed attention, and dense gated attention (what a file whose compress ratios
are 0 runs, spec 2.3), each with its hyper-connections and its 512-expert MoE, plus the output head.
Weights are random ggml blocks of the UD-Q4_K_XL type mix (UD_Q4_K_XL below), built as Bubo loads
a GGUF file (bubo.model.decoder_layer.build_layer over a WeightSource), so the measured code is the real
one: on CUDA with triton installed the paged-attention and gated-delta kernels, and whatever the
quantized linear layers use. The PLE layer (one of 48) is not built: its 51 B-entry table would not
fit, and it reads 16 table rows per token.

Per layer kind it times the token mixer, the MoE and the whole layer (the hyper-connections are the
rest) for one decode token at the context each prefill left, with the bytes each reads: weights (for
the MoE only the router, the shared expert and the top-k experts), the KV cache or recurrent state.
It then scales them to the whole model (36 DeltaNet + 12 attention layers + the head).

    python benchmarks/bench_layers.py --bandwidth-gbs 4800                 # an H200 (H100 SXM: 3350)
    python benchmarks/bench_layers.py --cpu-small                          # tiny widths, seconds

Without CUDA the tiny-width version runs (a check that the script works, not a measurement).
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from bubo.gguf.model_config import (  # noqa: E402
    DeltaNetSizes,
    IndexerSizes,
    MlpKind,
    ModelConfig,
    RopeStyle,
    ValueHeadOrder,
)
from bubo.gguf.quants import block_size, type_size  # noqa: E402
from bubo.kernels.triton_support import triton_enabled  # noqa: E402
from bubo.model.decoder import Decoder  # noqa: E402
from bubo.model.decoder_layer import DeltaNetMixer, HyperConnectedLayer, IndexedAttentionMixer  # noqa: E402
from bubo.model.hyper_connections import expand_streams  # noqa: E402
from bubo.model.moe import Experts, QuantizedExpertMatrices, SparseMoE  # noqa: E402
from bubo.model.quantized_linear import QuantizedEmbedding, QuantizedLinear  # noqa: E402
from bubo.model.state import KVCache  # noqa: E402

T = GGMLQuantizationType

# Qwen3.8-Flash-Next (spec section 1), and a tiny version with the same structure whose every row
# still holds whole 256-value K-quant blocks.
FLAGSHIP = {
    "hidden": 2560,
    "heads": 24,
    "kv_heads": 2,
    "head_dim": 256,
    "indexer_heads": 4,
    "indexer_dim": 128,
    "budget": 2048,
    "ratio": 4,
    "k_heads": 16,
    "v_heads": 48,
    "state_dim": 128,
    "experts": 512,
    "top_k": 10,
    "expert_ffn": 640,
    "shared_ffn": 640,
    "hc": 4,
    "rank": 320,
    "vocab": 248320,
    "mrope": (11, 11, 10),
}
SMALL = {
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "indexer_heads": 2,
    "indexer_dim": 32,
    "budget": 16,
    "ratio": 4,
    "k_heads": 2,
    "v_heads": 4,
    "state_dim": 64,
    "experts": 8,
    "top_k": 2,
    "expert_ffn": 64,
    "shared_ffn": 64,
    "hc": 4,
    "rank": 32,
    "vocab": 512,
    "mrope": (4, 2, 2),
}
# The real model's layers: 36 Gated DeltaNet, 12 attention (every 4th).
MODEL_LAYERS = {"deltanet": 36, "attention": 12}

# The UD-Q4_K_XL type of each tensor, by the end of its GGUF name; first match wins. An assumption
# [I]: Unsloth publishes no per-tensor table for this model, so this follows its dynamic recipes for
# Qwen3-Next-class MoEs — 4-bit K-quants for the routed experts' gate/up, wider types for attention,
# DeltaNet and shared-expert projections — and llama.cpp's rules: tensors whose rows are not whole
# 256-value blocks (ffn_down_exps and the shared down, ne0 = 640; hc_*_up, ne0 = 320) fall back to
# 32-value types, and routers, ssm_beta/alpha, the indexer and hyper-connection injections stay F32
# (spec 3.6). Edit here to measure another mix.
UD_Q4_K_XL = (
    ("ffn_gate_exps.weight", T.Q4_K),
    ("ffn_up_exps.weight", T.Q4_K),
    ("ffn_down_exps.weight", T.Q5_0),
    ("ffn_gate_shexp.weight", T.Q8_0),
    ("ffn_up_shexp.weight", T.Q8_0),
    ("ffn_down_shexp.weight", T.Q8_0),
    ("ffn_gate_inp.weight", T.F32),
    ("ffn_gate_inp_shexp.weight", T.F32),
    ("attn_qkv.weight", T.Q5_K),
    ("attn_gate.weight", T.Q5_K),
    ("ssm_out.weight", T.Q6_K),
    ("ssm_beta.weight", T.F32),
    ("ssm_alpha.weight", T.F32),
    ("attn_q.weight", T.Q5_K),
    ("attn_k.weight", T.Q6_K),
    ("attn_v.weight", T.Q6_K),
    ("attn_output.weight", T.Q6_K),
    ("indexer.q_proj.weight", T.F32),
    ("indexer.k_proj.weight", T.F32),
    ("_down.weight", T.Q8_0),
    ("_up.weight", T.Q8_0),
    ("_inject.weight", T.F32),
    ("token_embd.weight", T.Q4_K),
    ("output.weight", T.Q6_K),
)
# Byte offsets of each type's fp16 scale fields in a block: set to small finite values, so random
# blocks dequantize to weights of a sane size (random bytes there could be inf or NaN).
_SCALE_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q5_0: (0,)}


def ggml_type(name: str) -> GGMLQuantizationType:
    return next(t for suffix, t in UD_Q4_K_XL if name.endswith(suffix))


def random_blocks(shape: tuple[int, ...], kind: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    """Random raw ggml blocks uint8 [*shape[:-1], row_bytes] for a weight of torch shape `shape`."""
    rows, width = shape[:-1], shape[-1]
    if width % block_size(kind):
        raise ValueError(f"rows of {width} values don't hold whole {kind.name} blocks")
    row_bytes = width // block_size(kind) * type_size(kind)
    raw = torch.randint(0, 256, (*rows, row_bytes), dtype=torch.uint8, device=device)
    words = raw.view(-1, type_size(kind)).view(torch.int16)
    for offset in _SCALE_FIELDS[kind]:
        scales = (torch.rand(words.shape[0], device=device) * 2e-3 + 1e-3).to(torch.float16)
        words[:, offset // 2] = scales.view(torch.int16)
    return raw


class RandomWeights:
    """A WeightSource (bubo.model.decoder_layer) handing out random weights in the UD_Q4_K_XL types."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("ssm_a"):
            return -torch.rand(shape, device=self.device).to(self.dtype) - 0.5  # -exp(A_log) < 0
        scale = 1.0 if name.endswith("norm.weight") else 0.1
        return (1.0 + scale * torch.randn(shape, device=self.device)).to(self.dtype)

    def has(self, name: str) -> bool:
        return not name.endswith("ssm_in.weight")  # the qwen35-family layout: attn_qkv + attn_gate

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        kind = ggml_type(name)
        if kind == T.F32:
            layer = nn.Linear(shape[1], shape[0], bias=False, device=self.device, dtype=self.dtype)
            nn.init.normal_(layer.weight, std=shape[1] ** -0.5)
            return layer.requires_grad_(False)
        return QuantizedLinear(random_blocks(shape, kind, self.device), kind, in_features=shape[1])

    def embedding(self, name: str, shape: tuple[int, int]) -> nn.Module:
        raw = random_blocks(shape, ggml_type(name), self.device)
        return QuantizedEmbedding(raw, ggml_type(name), embedding_dim=shape[1], dtype=self.dtype)

    def experts(self, name: str, shape: tuple[int, int, int]) -> Experts:
        return QuantizedExpertMatrices(
            random_blocks(shape, ggml_type(name), self.device), ggml_type(name), shape[2]
        )

    def table(self, name: str, dim: int) -> tuple[torch.Tensor, GGMLQuantizationType | None]:
        raise ValueError("the benchmark builds no PLE layer")


def layer_config(s: dict, kinds: list[str]) -> ModelConfig:
    """A qwen4exp config of the given layer kinds ("deltanet", "qsa", "attention") at sizes `s`."""
    recurrent = tuple(kind == "deltanet" for kind in kinds)
    return ModelConfig(
        architecture="qwen4exp",
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_layers=len(kinds),
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=0,
        rms_norm_eps=1e-6,
        context_length=1 << 18,
        rope_theta=1e7,
        rope_dim=2 * sum(s["mrope"]),
        rope_style=RopeStyle.NEOX,
        qk_norm=True,
        mlp_kind=MlpKind.SPARSE_MOE_SHARED,
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        moe_intermediate_size=s["expert_ffn"],
        norm_topk_prob=True,
        shared_expert_intermediate_size=s["shared_ffn"],
        recurrent_layers=recurrent,
        deltanet=DeltaNetSizes(
            conv_kernel=4,
            num_k_heads=s["k_heads"],
            num_v_heads=s["v_heads"],
            head_k_dim=s["state_dim"],
            head_v_dim=s["state_dim"],
            value_head_order=ValueHeadOrder.TILED,
            gate_activation="sigmoid",
        ),
        mrope_sections=s["mrope"],
        hc_count=s["hc"],
        hc_low_rank=s["rank"],
        indexer=IndexerSizes(
            num_heads=s["indexer_heads"],
            head_dim=s["indexer_dim"],
            budget=s["budget"],
            compress_ratios=tuple(s["ratio"] if kind == "qsa" else 0 for kind in kinds),
        ),
    )


def module_bytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


def moe_bytes_per_token(moe: SparseMoE) -> int:
    """What one token's MoE reads: router, shared expert and its gate, and top_k routed experts."""
    per_expert = 0
    for experts in (moe.gate, moe.up, moe.down):
        tensor = experts.raw if isinstance(experts, QuantizedExpertMatrices) else experts.weight
        per_expert += tensor[0].nbytes
    shared = [m for m in (moe.router, moe.shared_expert, moe.shared_expert_gate) if m is not None]
    return sum(module_bytes(m) for m in shared) + moe.top_k * per_expert


def state_bytes_per_token(layer: HyperConnectedLayer, cache: KVCache, context: int) -> int:
    """Cache bytes one decode token reads (and, for the recurrent state, writes back)."""
    if isinstance(layer.attention, DeltaNetMixer):
        state = cache.recurrent[layer.attention.state_index]
        return 2 * (state.recurrent_state.nbytes + state.conv_state.nbytes)
    keys = cache.pool.keys[0]
    per_position = 2 * keys.shape[0] * keys.shape[2] * keys.element_size()
    if not isinstance(layer.attention, IndexedAttentionMixer):
        return context * per_position
    # QSA scores every complete block's key; the paged kernel then reads the selected positions
    # alone, where the torch path reads every position and masks.
    indexer = cache.indexers[layer.attention.state_index]
    block_keys = indexer.num_blocks * indexer.block_keys.shape[-1] * indexer.block_keys.element_size()
    read = layer.attention.attention.selected_count(context) if triton_enabled(keys.device) else context
    return read * per_position + block_keys


class Stopwatch:
    """Marks on the device's timeline (CUDA events) or the host clock; `seconds` after a sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
        return end - start  # type: ignore[operator]


@dataclass
class LayerTimes:
    """Seconds per call, summed over the calls made so far, per layer."""

    layer: list[float]
    mixer: list[float]
    moe: list[float]


def run_layers(
    model: Decoder, tokens: torch.Tensor, cache: KVCache, clock: Stopwatch, times: LayerTimes
) -> None:
    """One forward pass of `tokens` [1, T] through every layer (Decoder.hidden's loop), adding each
    layer's, its token mixer's and its MoE's time to `times`."""
    length = tokens.shape[1]
    cos, sin = model.rotary(cache.positions(length).to(model.device), model.dtype)
    x = expand_streams(model.embedding(tokens.to(model.device)), model.config.hc_count)
    marks = []
    for layer in model.layers:
        start = clock.mark()
        block_input, inject = layer.attn_hc(x)
        mixer_start = clock.mark()
        mixed = layer.attention(block_input, cos, sin, cache)
        mixer_end = clock.mark()
        x = layer.attn_hc.combine(x, inject, mixed)
        block_input, inject = layer.ffn_hc(x)
        moe_start = clock.mark()
        out = layer.mlp(block_input)
        moe_end = clock.mark()
        x = layer.ffn_hc.combine(x, inject, out)
        marks.append((start, mixer_start, mixer_end, moe_start, moe_end, clock.mark()))
    cache.advance(length)
    for i, (start, mixer_start, mixer_end, moe_start, moe_end, end) in enumerate(marks):
        times.layer[i] += clock.seconds(start, end)
        times.mixer[i] += clock.seconds(mixer_start, mixer_end)
        times.moe[i] += clock.seconds(moe_start, moe_end)


def timed(fn: Callable[[], object], clock: Stopwatch, repeats: int) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    start = clock.mark()
    for _ in range(repeats):
        fn()
    return clock.seconds(start, clock.mark()) / repeats


def measure(
    model: Decoder,
    kinds: list[str],
    prompt: int,
    chunk: int,
    decode_steps: int,
    clock: Stopwatch,
    profile: bool = False,
) -> dict:
    """Prefill `prompt` tokens (in pieces of `chunk`), then `decode_steps` decode tokens at that
    context: per layer kind the mean times and the bytes read per decode token; with `profile`, also
    the device kernels one more decode token runs (`_profile_decode`)."""
    n = len(kinds)
    cache = model.new_cache(max_len=prompt + decode_steps + 2)
    generator = torch.Generator().manual_seed(prompt)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt + decode_steps + 1), generator=generator)
    prefill = LayerTimes([0.0] * n, [0.0] * n, [0.0] * n)
    with torch.inference_mode():
        for start in range(0, prompt, chunk):
            run_layers(model, tokens[:, start : min(start + chunk, prompt)], cache, clock, prefill)
        decode = LayerTimes([0.0] * n, [0.0] * n, [0.0] * n)
        run_layers(
            model, tokens[:, prompt : prompt + 1], cache, clock, LayerTimes([0.0] * n, [0.0] * n, [0.0] * n)
        )
        for step in range(decode_steps):
            run_layers(model, tokens[:, prompt + 1 + step : prompt + 2 + step], cache, clock, decode)
        context = cache.length
        head_input = torch.randn(1, 1, model.config.hidden_size, device=model.device, dtype=model.dtype)
        head = timed(lambda: model.output(head_input), clock, decode_steps)

    report: dict = {"prompt_tokens": prompt, "decode_context": context, "kinds": {}}
    for kind in dict.fromkeys(kinds):
        index = [i for i, k in enumerate(kinds) if k == kind]
        layer = model.layers[index[0]]
        mixer_weights = module_bytes(layer.attention)
        moe_weights = moe_bytes_per_token(layer.mlp)
        hc_weights = module_bytes(layer.attn_hc) + module_bytes(layer.ffn_hc)
        cache_bytes = state_bytes_per_token(layer, cache, context)

        def mean(values: list[float], steps: int, index: list[int] = index) -> float:
            return sum(values[i] for i in index) / len(index) / steps

        report["kinds"][kind] = {
            "decode_s": {
                "layer": mean(decode.layer, decode_steps),
                "mixer": mean(decode.mixer, decode_steps),
                "moe": mean(decode.moe, decode_steps),
            },
            "prefill_s": {
                "layer": mean(prefill.layer, 1),
                "mixer": mean(prefill.mixer, 1),
                "moe": mean(prefill.moe, 1),
            },
            "bytes_per_token": {
                "mixer_weights": mixer_weights,
                "moe_weights": moe_weights,
                "hc_weights": hc_weights,
                "cache": cache_bytes,
                "layer": mixer_weights + moe_weights + hc_weights + cache_bytes,
            },
        }
    report["head"] = {"decode_s": head, "bytes_per_token": module_bytes(model.output)}
    report["model"] = _whole_model(report, kinds)
    if profile:  # last: the profiled token moves the cache on
        with torch.inference_mode():
            report["decode_kernels"] = _profile_decode(model, tokens[:, -1:], cache, clock)
    return report


def _profile_decode(model: Decoder, token: torch.Tensor, cache: KVCache, clock: Stopwatch) -> dict:
    """One decode token through every layer under torch.profiler: how many device kernels it launches,
    their summed device time against the step's wall time (the rest is launch and host overhead),
    and the kernels that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    n = len(model.layers)
    times = LayerTimes([0.0] * n, [0.0] * n, [0.0] * n)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        run_layers(model, token, cache, clock, times)
        if clock.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"] if clock.cuda else []
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "layers": n,
        "wall_s": wall,
        "kernel_launches": sum(e.count for e in kernels),
        "kernel_s": sum(e.self_device_time_total for e in kernels) / 1e6,
        "top": [
            {"name": e.key[:90], "calls": e.count, "s": e.self_device_time_total / 1e6} for e in kernels[:15]
        ],
    }


def _whole_model(report: dict, kinds: list[str]) -> dict:
    """The per-kind figures scaled to the real layer counts; QSA stands for the attention layers
    when measured, else dense attention."""
    attention = "qsa" if "qsa" in kinds else "attention"
    parts = {"deltanet": report["kinds"]["deltanet"], "attention": report["kinds"][attention]}
    decode = (
        sum(MODEL_LAYERS[k] * p["decode_s"]["layer"] for k, p in parts.items()) + report["head"]["decode_s"]
    )
    weights = (
        sum(
            MODEL_LAYERS[k] * (p["bytes_per_token"]["layer"] - p["bytes_per_token"]["cache"])
            for k, p in parts.items()
        )
        + report["head"]["bytes_per_token"]
    )
    cache = sum(MODEL_LAYERS[k] * p["bytes_per_token"]["cache"] for k, p in parts.items())
    prefill = sum(MODEL_LAYERS[k] * p["prefill_s"]["layer"] for k, p in parts.items())
    return {
        "decode_s_per_token": decode,
        "decode_tokens_per_s": 1 / decode,
        "weight_bytes_per_token": weights,
        "cache_bytes_per_token": cache,
        "prefill_tokens_per_s": report["prompt_tokens"] / prefill,
    }


def _fraction(nbytes: int, seconds: float, bandwidth_gbs: float | None) -> str:
    if not bandwidth_gbs:
        return "-"
    return f"{nbytes / seconds / (bandwidth_gbs * 1e9):.0%}"


def print_report(report: dict, bandwidth_gbs: float | None) -> None:
    print(
        f"\nprompt {report['prompt_tokens']} tokens, decode at context {report['decode_context']}"
        + (f", bandwidth fractions of {bandwidth_gbs:g} GB/s" if bandwidth_gbs else "")
    )
    print("| kind | part | decode µs | MB read/token | of bandwidth | prefill ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind, r in report["kinds"].items():
        b = r["bytes_per_token"]
        read = {
            "mixer": b["mixer_weights"] + b["cache"],
            "moe": b["moe_weights"],
            "layer": b["layer"],
        }
        for part in ("mixer", "moe", "layer"):
            seconds = r["decode_s"][part]
            print(
                f"| {kind} | {part} | {seconds * 1e6:.0f} | {read[part] / 1e6:.2f} | "
                f"{_fraction(read[part], seconds, bandwidth_gbs)} | {r['prefill_s'][part] * 1e3:.1f} |"
            )
    head = report["head"]
    print(
        f"| head | output | {head['decode_s'] * 1e6:.0f} | {head['bytes_per_token'] / 1e6:.2f} | "
        f"{_fraction(head['bytes_per_token'], head['decode_s'], bandwidth_gbs)} | |"
    )
    kernels = report.get("decode_kernels")
    if kernels:
        print(
            f"one decode token through {kernels['layers']} layers: {kernels['kernel_launches']} kernels, "
            f"{kernels['kernel_s'] * 1e3:.2f} ms of kernel time in {kernels['wall_s'] * 1e3:.2f} ms (profiled)"
        )
        for k in kernels["top"]:
            print(f"    {k['s'] * 1e6:9.0f} µs {k['calls']:4d}x  {k['name']}")
    m = report["model"]
    print(
        f"whole model (36 DeltaNet + 12 attention layers + head, no PLE): decode {m['decode_s_per_token'] * 1e3:.2f} ms"
        f"/token ({m['decode_tokens_per_s']:.1f} tok/s), weights {m['weight_bytes_per_token'] / 1e9:.2f} GB/token "
        f"+ cache {m['cache_bytes_per_token'] / 1e6:.1f} MB, "
        f"{_fraction(m['weight_bytes_per_token'] + m['cache_bytes_per_token'], m['decode_s_per_token'], bandwidth_gbs)}"
        f" of bandwidth; prefill {m['prefill_tokens_per_s']:.0f} tok/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-small", action="store_true", help="tiny widths on the CPU (the default without CUDA)"
    )
    parser.add_argument("--bandwidth-gbs", type=float, help="the device's peak memory bandwidth, GB/s")
    parser.add_argument("--prompts", default=None, help="prefill lengths, comma-separated (4096,32768)")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill piece length")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decode tokens per prompt")
    parser.add_argument("--layers-per-kind", type=int, default=2)
    parser.add_argument("--kinds", default="deltanet,qsa,attention")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--profile", action="store_true", help="list the device kernels of one decode token (torch.profiler)"
    )
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the untimed first pass that compiles and autotunes the kernels before the timed ones",
    )
    args = parser.parse_args(argv)

    small = args.cpu_small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    sizes = SMALL if small else FLAGSHIP
    prompts = [int(p) for p in (args.prompts or ("64,256" if small else "4096,32768")).split(",")]
    decode_steps = args.decode_steps or (4 if small else 32)
    chunk = min(args.chunk, 128) if small else args.chunk
    kinds = [k for k in args.kinds.split(",") for _ in range(args.layers_per_kind)]
    if "deltanet" not in kinds or not {"qsa", "attention"} & set(kinds):
        parser.error("--kinds needs deltanet and at least one of qsa, attention")

    torch.manual_seed(0)
    started = time.perf_counter()
    model = Decoder(layer_config(sizes, kinds), RandomWeights(dtype, device)).eval()
    print(
        f"{'tiny' if small else 'Qwen3.8-Flash-Next'} layers {kinds} on {device} ({dtype}), "
        f"built in {time.perf_counter() - started:.1f} s"
    )
    clock = Stopwatch(device)
    if not args.no_warm_up:
        # Triton compiles and autotunes each kernel shape on its first call: keep that out of the figures.
        started = time.perf_counter()
        measure(model, kinds, min(2 * chunk, min(prompts)), chunk, 2, clock)
        print(f"warm-up pass (compiles, autotuning) took {time.perf_counter() - started:.1f} s")
    reports = []
    for prompt in prompts:
        report = measure(model, kinds, prompt, chunk, decode_steps, clock, profile=args.profile)
        print_report(report, args.bandwidth_gbs)
        reports.append(report)
    if args.json:
        device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.json.write_text(
            json.dumps(
                {"device": device_name, "small": small, "bandwidth_gbs": args.bandwidth_gbs, "runs": reports},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
