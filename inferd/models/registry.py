"""Architecture name (a config's ``architectures[0]``) -> model class."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from inferd.models.config import ModelArchConfig
from inferd.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with different config values (Qwen2: q/k/v bias).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(
    config: ModelArchConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> nn.Module:
    """An instance of the architecture on ``device`` in ``dtype``.

    Parameter memory is allocated but NOT initialised: fill it with the
    model's ``load_weights`` before running it.
    """
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"model architecture {config.architecture!r} is not supported (supported: {supported})"
        )
    # Built on the meta device so no memory or time goes into random
    # initialisation that the checkpoint overwrites anyway; the init
    # functions are skipped too, since even on meta their first call imports
    # torch's Python reference ops (1.2 s of a cold start here).
    with torch.device("meta"), _no_init():
        model = cls(config)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    return model.eval()


@contextmanager
def _no_init() -> Iterator[None]:
    names = ("normal_", "uniform_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
