"""Bubo: a pure-PyTorch LLM runtime for GGUF files.

    import bubo
    model = bubo.load()  # the default model; or bubo.load("file.gguf", device="cuda")
    print(model.generate("The capital of France is", max_tokens=8, temperature=0).content_text)

The names below are imported on first use, so `import bubo` stays cheap (the CLI reads `__version__`
before it imports torch).
"""

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ChatResult",
    "Finished",
    "Model",
    "OutputDelta",
    "RequestError",
    "RuntimeOptions",
    "SamplingParams",
    "__version__",
    "load",
]

_EXPORTS = {
    "load": "bubo.api",
    "Model": "bubo.api",
    "ChatResult": "bubo.api",
    "RequestError": "bubo.engine.request_error",
    "RuntimeOptions": "bubo.options",
    "SamplingParams": "bubo.engine.sampler",
    "OutputDelta": "bubo.engine.request",
    "Finished": "bubo.engine.request",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bubo' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
