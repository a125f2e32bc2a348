"""inferd: a self-hostable, air-gap-ready AI inference platform.

The public names load on first use, so importing a torch-free module such as
``inferd.engine.kv_cache`` does not pull in torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "inferd.engine.llm",
    "LLMEngine": "inferd.engine.engine",
    "EngineConfig": "inferd.config",
    "SamplingParams": "inferd.sampling_params",
    "RequestOutput": "inferd.engine.outputs",
    "CompletionOutput": "inferd.engine.outputs",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from inferd.config import EngineConfig
    from inferd.engine.engine import LLMEngine
    from inferd.engine.llm import LLM
    from inferd.engine.outputs import CompletionOutput, RequestOutput
    from inferd.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inferd' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
