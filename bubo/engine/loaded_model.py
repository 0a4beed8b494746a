"""A GGUF file opened into everything generation needs: config, decoder and tokenizer."""

from dataclasses import dataclass
from pathlib import Path

import torch

from bubo.engine.compiled_decode import prepare_decode_step
from bubo.gguf.config import ModelConfig, config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: Path
    file: GGUFFile
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> LoadedModel:
    """Open `path`, check its architecture, and build the decoder and tokenizer from it.

    The config is read first so an unsupported architecture fails before any weight is touched.
    """
    file = GGUFFile(path)
    try:
        config = config_from_gguf(file)
        tokenizer = Tokenizer.from_gguf(file.metadata)
        model = load_decoder(file, config, dtype=dtype, device=device, progress=progress)
        prepare_decode_step(model)
    except BaseException:
        file.close()
        raise
    return LoadedModel(Path(path), file, config, model, tokenizer)
