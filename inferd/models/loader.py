"""One entry point for loading a checkpoint, whatever its format.

``load_checkpoint`` takes a ``.gguf`` file or a Hugging Face directory (one
with ``config.json``) and returns a ``Checkpoint``: the architecture config,
the tokenizer, and a lazy stream of weights under Hugging Face parameter
names in Hugging Face layouts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from inferd.models.config import ModelArchConfig
from inferd.models.gguf_loader import GGUFCheckpoint
from inferd.models.hf_loader import HFCheckpoint
from inferd.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CHECKPOINT_FORMATS = ("gguf", "hf")
_GGUF_MAGIC = b"GGUF"


class WeightSource(Protocol):
    def weight_names(self) -> list[str]: ...
    def weights(self, dtype: torch.dtype, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class Checkpoint:
    path: Path
    format: str  # one of CHECKPOINT_FORMATS
    config: ModelArchConfig
    tokenizer: Tokenizer
    # The open file or directory; a GGUFCheckpoint also gives raw quantized blocks.
    source: WeightSource = field(repr=False)

    def __post_init__(self) -> None:
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint format must be one of {CHECKPOINT_FORMATS}, got {self.format!r}")

    def weight_names(self) -> list[str]:
        return self.source.weight_names()

    def weights(self, dtype: torch.dtype = torch.float32, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs, read and converted one at a time; linears are
        ``[out_features, in_features]``; no ``lm_head.weight`` when tied. Names
        in ``skip`` are not read at all."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"weights dtype must be a floating-point torch.dtype, got {dtype!r}")
        return self.source.weights(dtype, skip)


def load_checkpoint(path: str | Path, supported_architectures: tuple[str, ...] = SUPPORTED_ARCHITECTURES) -> Checkpoint:
    """Open a ``.gguf`` file or a Hugging Face checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: checkpoint path does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = "; pass the .gguf file itself" if any(path.glob("*.gguf")) else ""
            raise ValueError(f"{path}: directory has no config.json, so it is not a Hugging Face checkpoint{hint}")
        hf = HFCheckpoint(path, supported_architectures)
        return Checkpoint(path, "hf", hf.config, hf.tokenizer(), hf)
    if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
        raise ValueError(f"{path}: not a checkpoint: expected a .gguf file or a directory with config.json")
    gguf = GGUFCheckpoint(path)
    if gguf.config.architecture not in supported_architectures:
        raise ValueError(
            f"{path}: architecture {gguf.config.architecture!r} is not supported "
            f"(supported: {', '.join(supported_architectures)})"
        )
    return Checkpoint(path, "gguf", gguf.config, gguf.tokenizer(), gguf)


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError as e:
        raise ValueError(f"{path}: cannot read the file ({e})") from e
