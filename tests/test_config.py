from __future__ import annotations

import pytest
import torch

from inferd.cli import parse_config
from inferd.config import EngineConfig


def test_quantization_fields_are_validated_by_name():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4; got 'int3'"):
        EngineConfig(quantization="int3")
    for bad in (16, 48, 256, 32.0, True):
        with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128"):
            EngineConfig(quantization_group_size=bad)
    assert EngineConfig(quantization="int4", quantization_group_size=128).quantization_group_size == 128


def test_quantized_models_default_to_bfloat16_only_with_bf16_hardware(monkeypatch):
    from inferd.layers import quant

    cpu = torch.device("cpu")
    assert EngineConfig().resolve_dtype(cpu) == torch.float32
    for hardware in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(quant, "matmul_dtype", lambda hardware=hardware: hardware)
        assert EngineConfig(quantization="int8").resolve_dtype(cpu) == hardware
        assert EngineConfig(quantization="int4").resolve_dtype(cpu) == hardware
        assert EngineConfig(quantization="int4", dtype="bfloat16").resolve_dtype(cpu) == torch.bfloat16
    assert EngineConfig(quantization="int4", dtype="float32").resolve_dtype(cpu) == torch.float32


def test_quantization_flags_flow_into_the_engine_config():
    cfg = parse_config(["generate", "hi", "--quantization", "int4", "--quant-group-size", "64"])
    assert (cfg.engine.quantization, cfg.engine.quantization_group_size) == ("int4", 64)
    serve = parse_config(["serve", "--quantization", "int8"])
    assert serve.engine.quantization == "int8" and serve.engine.quantization_group_size == 32
    assert parse_config(["chat"]).engine.quantization == "none"
    with pytest.raises(SystemExit):
        parse_config(["generate", "hi", "--quant-group-size", "48"])
