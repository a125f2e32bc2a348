"""Fixtures shared across the suite: the default model, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path():
    from inferd.models.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llm(default_model_path):
    """The default model in float32 with a roomy KV cache."""
    from inferd import LLM

    return LLM(str(default_model_path), dtype="float32", kv_cache_memory_gb=1.0, max_model_len=2048)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' own loading of the same GGUF, float32: the reference.

    Its generation config has no EOS, so generate() runs to max_new_tokens
    the way inferd's ignore_eos does (min_new_tokens would instead mask EOS
    out of the logits and change the greedy choice)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    return model.eval()
