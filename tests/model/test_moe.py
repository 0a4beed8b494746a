"""qwen3moe (sparse mixture of experts) against transformers' Qwen3MoeForCausalLM.

A tiny random model (float32, eager attention, 8 experts top-2, 3 layers, every weight random:
router and norms included) is written to GGUF by the fixture writer and run by Bubo: a 64-token
prefill, then 32 single-token decode steps through the KV cache, each compared with transformers'
logits for the same positions. Float experts and quantized ones (the fixture swaps the reference's
weights for their dequantized values, so it stays exact) must both match within 1e-3; measured:
at most 2.2e-6.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import bubo.model.moe
import bubo.model.quantized_linear
from bubo.gguf.config import config_from_gguf
from bubo.gguf.model_config import MlpKind
from bubo.gguf.reader import GGUFError, GGUFFile
from bubo.kernels.codes import TILE
from bubo.kernels.int8_matvec import int8_matvec_enabled
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.moe import ExpertMatrices, QuantizedExpertMatrices, SparseMoE, merge_gate_up, top_k_routing
from tests.fixtures.compare import prefill_and_decode_deltas
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.op_calls import OpCalls
from tests.kernels.k_blocks import random_blocks

# The float matvecs, exact activations (tests/conftest.py); the int8 ones: tests/kernels/test_int8_matvec.py.
pytestmark = pytest.mark.usefixtures("float_matvecs")


TOLERANCE = 1e-3  # fp32 Bubo vs fp32 transformers (TESTING.md)
PREFILL, DECODE, BATCH = 64, 32, 2


def _reference(tie_word_embeddings: bool = False) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,  # written as feed_forward_length, as the converter does; unused
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        # Qwen3-30B-A3B's own setting, and what llama.cpp's qwen3moe always does.
        norm_topk_prob=True,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=300,
        rms_norm_eps=1e-6,
        max_position_embeddings=PREFILL + DECODE,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = Qwen3MoeForCausalLM(config)
    model.config._attn_implementation = "eager"
    randomize_(model)
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, PREFILL + DECODE), generator=torch.Generator().manual_seed(1))


def _load(path: Path) -> tuple[GGUFFile, Decoder]:
    f = GGUFFile(path)
    return f, load_decoder(f, config_from_gguf(f))


def _check_against_reference(reference: Qwen3MoeForCausalLM, model: Decoder, label: str) -> None:
    tokens = _tokens(reference.config.vocab_size)
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, tokens, PREFILL)
    print(f"{label}: max|Δlogit| prefill {d_prefill:.2e}, cached decode {d_decode:.2e}")
    assert d_prefill <= TOLERANCE
    assert d_decode <= TOLERANCE


_EXPERTS_Q = {
    "blk.*.ffn_gate_exps.weight": Q.Q4_0,
    "blk.*.ffn_up_exps.weight": Q.Q8_0,
    "blk.*.ffn_down_exps.weight": Q.Q4_0,
    "blk.*.attn_q.weight": Q.Q8_0,
}


# As a Q4_K_M file has them: gate and up in one type (merged into one packed matrix), down in another.
PACKED_EXPERTS_Q = {
    "blk.*.ffn_gate_exps.weight": Q.Q4_1,
    "blk.*.ffn_up_exps.weight": Q.Q4_1,
    "blk.*.ffn_down_exps.weight": Q.Q8_0,
}


def test_every_layer_is_a_sparse_moe(tmp_path: Path) -> None:
    _, model = _load(write_gguf(_reference(), tmp_path / "moe.gguf"))
    assert model.config.mlp_kind == MlpKind.SPARSE_MOE
    for layer in model.layers:
        assert isinstance(layer.mlp, SparseMoE)
        assert isinstance(layer.mlp.gate, ExpertMatrices)
        assert layer.mlp.gate.weight.shape == (8, 32, 64)
        assert layer.mlp.down.weight.shape == (8, 64, 32)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_transformers(tied: bool, tmp_path: Path) -> None:
    reference = _reference(tie_word_embeddings=tied)
    _, model = _load(write_gguf(reference, tmp_path / "moe.gguf"))
    _check_against_reference(reference, model, f"qwen3moe {'tied' if tied else 'untied'}")


def test_quantized_experts_match_dequantized_reference(tmp_path: Path) -> None:
    reference = _reference()
    f, model = _load(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=_EXPERTS_Q))
    moe = model.layers[1].mlp
    assert isinstance(moe.gate, QuantizedExpertMatrices) and moe.gate.ggml_type == Q.Q4_0
    assert isinstance(moe.up, QuantizedExpertMatrices) and moe.up.ggml_type == Q.Q8_0
    # Zero-copy: the raw blocks [experts, rows, row_bytes] are the memory map's bytes.
    assert moe.down.raw.shape == (8, 64, 32 // 32 * 18)
    assert moe.down.raw.data_ptr() == f.tensors["blk.1.ffn_down_exps.weight"].raw.data_ptr()
    _check_against_reference(reference, model, "qwen3moe quantized experts")


def test_quantized_experts_through_the_triton_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused MoE kernel and the GEMV / GEMM ones (attn_q) in the whole model, against transformers:
    run on this CPU model by triton's interpreter, as CUDA would run them compiled."""
    pytest.importorskip("triton")
    from bubo.kernels.triton_quant import interpreting

    if not interpreting():
        pytest.skip("a CPU model runs the Triton kernels only in triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(bubo.model.moe, "triton_enabled", lambda device: True)
    monkeypatch.setattr(bubo.model.quantized_linear, "triton_enabled", lambda device: True)
    reference = _reference()
    _, model = _load(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=_EXPERTS_Q))
    # Shorter than the other comparisons (one sequence, 16 + 8 tokens): the interpreter is slow.
    tokens = _tokens(reference.config.vocab_size)[:1, :24]
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, tokens, 16)
    print(
        f"qwen3moe quantized experts, Triton kernels: max|Δlogit| prefill {d_prefill:.2e}, decode {d_decode:.2e}"
    )
    assert d_prefill <= TOLERANCE
    assert d_decode <= TOLERANCE


def test_decode_dequantizes_only_the_routed_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, model = _load(write_gguf(_reference(), tmp_path / "moe-q.gguf", quantize=_EXPERTS_Q))
    calls: list[torch.Tensor] = []
    dequantize: Callable[..., torch.Tensor] = bubo.model.moe.dequantize

    def counting(raw: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(raw)
        return dequantize(raw, *args, **kwargs)

    monkeypatch.setattr(bubo.model.moe, "dequantize", counting)
    with torch.no_grad():
        model(_tokens(300)[:1, :1], model.new_cache(batch=1, max_len=4))
    # One token: top-2 experts, each dequantized once per expert matrix, in each of 3 layers.
    assert len(calls) == 3 * 3 * 2
    assert all(raw.dim() == 2 for raw in calls)  # one expert's rows, never the whole stack


def test_router_renormalises_the_top_k() -> None:
    """With norm_topk_prob the chosen experts' weights sum to 1, so a block whose experts all compute
    the same function returns that function; without it the output is scaled by the kept probability."""
    g = torch.Generator().manual_seed(0)
    hidden, ffn, n = 8, 4, 4
    router = torch.nn.Linear(hidden, n, bias=False, device="meta")
    router.weight = torch.nn.Parameter(torch.randn(n, hidden, generator=g), requires_grad=False)
    gate, up, down = (
        torch.randn(shape, generator=g) for shape in ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    )

    def block(norm: bool) -> SparseMoE:
        def stack(w: torch.Tensor) -> ExpertMatrices:
            return ExpertMatrices(w.expand(n, *w.shape).clone())

        return SparseMoE(router, stack(gate), stack(up), stack(down), top_k=2, norm_topk_prob=norm)

    x = torch.randn(5, hidden, generator=g)
    one_expert = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
    with torch.no_grad():
        torch.testing.assert_close(block(True)(x), one_expert)
        kept = torch.softmax(router(x), -1).topk(2, -1).values.sum(-1, keepdim=True)
        torch.testing.assert_close(block(False)(x), one_expert * kept)


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    f = GGUFFile(write_gguf(_reference(), tmp_path / "moe.gguf"))
    del f.tensors["blk.2.ffn_up_exps.weight"]
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.ffn_up_exps\.weight'"):
        load_decoder(f, config_from_gguf(f))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda(tmp_path: Path) -> None:
    reference = _reference()
    f = GGUFFile(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=_EXPERTS_Q))
    model = load_decoder(f, config_from_gguf(f), device="cuda")
    tokens = _tokens(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens.cuda(), model.new_cache(batch=BATCH, max_len=PREFILL + DECODE)).cpu()
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_packed_experts_match_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert stacks repacked for the CPU's compiled matvecs (here at the tiny model's widths): a prefill's
    many rows through unpacked chunks, and each decoded step (one sequence's token, or the rows of a batch
    of two) through one compiled graph that gathers the routed experts from the stacks."""
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    graphs: list[tuple] = []
    kernel_for = bubo.model.moe._gathered_experts_kernel

    def counting(*key: Any) -> Any:
        graphs.append(key)
        return kernel_for(*key)

    monkeypatch.setattr(bubo.model.moe, "_gathered_experts_kernel", counting)
    reference = _reference()
    _, model = _load(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=PACKED_EXPERTS_Q))
    for layer in model.layers:
        # gate and up merged into one packed matrix (their own copies dropped), down packed alone.
        assert layer.mlp.packed_experts and layer.mlp.gate_up is not None
        assert layer.mlp.gate.packed is None and layer.mlp.up.packed is None
    _check_against_reference(reference, model, "qwen3moe packed experts, batch of 2")
    # The prefill's many rows took the grouped loop; each decoded step of the batch, the gathering graph.
    assert graphs
    graphs.clear()
    tokens = _tokens(reference.config.vocab_size)[:1]
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, tokens, PREFILL)
    print(
        f"qwen3moe packed experts, one sequence: max|Δlogit| prefill {d_prefill:.2e}, decode {d_decode:.2e}"
    )
    assert d_prefill <= TOLERANCE
    assert d_decode <= TOLERANCE
    # Every decoded token, in each of 3 layers: one graph for its top 2 experts.
    assert len(graphs) == DECODE * 3


# The same model and steps with the int8 matvecs (activations rounded to int8 per block of 32, as llama.cpp
# multiplies): measured max |Δlogit| 8.8e-3 over the prompt and 1.9e-3 over the decoded steps (2e-2 for a batch
# of two), against the float matvecs' 2e-6; these random logits are ~1 in size. The bound keeps ~2.5x headroom.
INT8_TOLERANCE = 5e-2


def _int8_packed_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_options: Callable[..., None]
) -> tuple[Qwen3MoeForCausalLM, Decoder]:
    """The reference and its file with packed experts, loaded with the int8 matvecs on (skips without them)."""
    runtime_options(int8_matvec=True)
    if not int8_matvec_enabled():
        pytest.skip("the int8 matvecs need AVX512-VNNI or AVX2 and a C++ compiler")
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    reference = _reference()
    _, model = _load(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=PACKED_EXPERTS_Q))
    return reference, model


def test_packed_experts_with_int8_matvecs_stay_near_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_options: Callable[..., None]
) -> None:
    reference, model = _int8_packed_model(tmp_path, monkeypatch, runtime_options)
    assert all(layer.mlp.packed_experts for layer in model.layers)
    tokens = _tokens(reference.config.vocab_size)[:1]
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, tokens, PREFILL)
    print(f"qwen3moe packed experts, int8: max|Δlogit| prefill {d_prefill:.2e}, decode {d_decode:.2e}")
    assert d_decode > 1e-4  # the int8 kernels ran (the float ones stay within ~2e-6)
    assert d_prefill <= INT8_TOLERANCE
    assert d_decode <= INT8_TOLERANCE


def test_a_short_prompts_experts_run_as_one_int8_call_per_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime_options: Callable[..., None]
) -> None:
    """More rows than the compiled gathered graph takes (a short prompt's) run through the int8 kernels'
    (row, expert) pairs eagerly, one call for the gate|up stack and one for down, and give what each row
    gives alone (the same kernels; the SwiGLU between them eager rather than fused by inductor)."""
    reference, model = _int8_packed_model(tmp_path, monkeypatch, runtime_options)
    moe = model.layers[0].mlp
    rows = bubo.model.quantized_linear.MATVEC_ROWS + 9
    x = torch.randn(rows, reference.config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, chosen = top_k_routing(moe.router(x), moe.top_k, moe.norm_topk_prob)
    assert moe._int8_rows(x) and not moe._gathered(x)
    with torch.inference_mode(), OpCalls() as ops:
        together = moe.routed(x, weights, chosen)
    assert [op.name() for op in ops.calls if op.namespace == "bubo_int8"] == [
        "bubo_int8::q4_matvec",
        "bubo_int8::q8_matvec",
    ]
    with torch.inference_mode():
        alone = torch.cat(
            [moe.routed(x[r : r + 1], weights[r : r + 1], chosen[r : r + 1]) for r in range(rows)]
        )
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_experts_are_packed_only_in_whole_tiles(monkeypatch: pytest.MonkeyPatch, runtime_options) -> None:
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    raw = torch.zeros(4, TILE + 4, 18, dtype=torch.uint8)  # Q4_0 rows of 32 weights, not whole tiles
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is None
    raw = torch.zeros(4, 2 * TILE, 18, dtype=torch.uint8)
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is not None
    runtime_options(pack_experts=False)  # the file's bytes, for the memory
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is None
    runtime_options(pack_experts=True)
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 2 * TILE * 32 + 1)
    # An expert below the threshold stays unpacked however many experts there are.
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is None


def test_gate_and_up_of_different_types_stay_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gate Q4_0 and up Q8_0 can't share a packed matrix: each stack keeps its own, the tokens run through
    the loop (no one-token graph), and the logits still match."""
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    reference = _reference()
    _, model = _load(write_gguf(reference, tmp_path / "moe-q.gguf", quantize=_EXPERTS_Q))
    moe = model.layers[0].mlp
    assert moe.gate_up is None and not moe.packed_experts
    assert all(s.packed is not None for s in (moe.gate, moe.up, moe.down))
    d_prefill, d_decode = prefill_and_decode_deltas(reference, model, _tokens(300)[:1, :24], 16)
    assert d_prefill <= TOLERANCE and d_decode <= TOLERANCE


@pytest.mark.parametrize("types", [(Q.Q6_K, Q.Q8_0), (Q.Q5_K, Q.IQ4_XS)])
def test_gate_and_up_of_other_layouts_stay_apart(monkeypatch: pytest.MonkeyPatch, types: tuple[Q, Q]) -> None:
    """No one packed matrix can hold both: Q6_K's super-blocks and Q8_0's blocks; Q5_K's and IQ4_XS's
    super-blocks, which have as many code words but other fields."""
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    gate, up = (
        QuantizedExpertMatrices(
            torch.from_numpy(random_blocks(qtype, 2 * 2 * TILE, 256, seed=1)).view(2, 2 * TILE, -1),
            qtype,
            in_features=256,
        )
        for qtype in types
    )
    assert merge_gate_up(gate, up) is None
    assert gate.packed is not None and up.packed is not None


def test_experts_stay_unpacked_when_memory_is_short(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Repacking a stack that would leave less than PACKING_RESERVE available keeps the file's blocks
    (the model loads and runs, slower) and says so once, rather than running the machine out of memory."""
    monkeypatch.setattr(bubo.model.quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setattr(bubo.model.quantized_linear, "_said_short_of_memory", False)
    raw = torch.zeros(4, 2 * TILE, 18, dtype=torch.uint8)
    reserve = bubo.model.quantized_linear.PACKING_RESERVE
    monkeypatch.setattr(
        bubo.model.quantized_linear, "meminfo", lambda: {"MemAvailable": reserve + 2 * raw.numel()}
    )
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is not None
    # Q4_0 packs into 5 bits a weight against the file's 4.5
    monkeypatch.setattr(
        bubo.model.quantized_linear, "meminfo", lambda: {"MemAvailable": reserve + raw.numel()}
    )
    with caplog.at_level("WARNING", logger="bubo.model.quantized_linear"):
        assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is None
        assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is None
    assert len([r for r in caplog.records if "file's blocks" in r.getMessage()]) == 1
    monkeypatch.setattr(bubo.model.quantized_linear, "meminfo", dict)  # no /proc/meminfo: nothing to go by
    assert QuantizedExpertMatrices(raw, Q.Q4_0, in_features=32).packed is not None
