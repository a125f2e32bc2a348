"""Decode steps through the fused C layers against the per-op PyTorch path,
on a small random Llama over a real runner and KV cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inferd.engine.request import Request
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from inferd.layers import fused_decode
from inferd.layers.fused_decode import FUSED_MAX_ROWS, FusedDecoder
from inferd.models.config import ModelArchConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.models.quantize import quantize_model
from inferd.sampling_params import SamplingParams

VOCAB = 96
BLOCK_SIZE = 4


def _config(attention_bias: bool = False) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        attention_bias=attention_bias,
    )


def _model(config: ModelArchConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.eval().to(dtype)


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [(5 * j + 3 * i) % VOCAB for j in range(6 + 3 * i)], SamplingParams()) for i in range(n)]


def _prefill_then_decode(runner: ModelRunner, reqs: list[Request]) -> SchedulerOutput:
    """Prefills every request but its last token; returns the step that
    decodes that token for all of them (contexts of different lengths)."""
    tables = {r.request_id: list(range(16 * i, 16 * i + 16)) for i, r in enumerate(reqs)}
    prefill = [ScheduledRequest(r, 0, r.num_tokens - 1, tables[r.request_id]) for r in reqs]
    runner.compute_logits(SchedulerOutput(prefill))
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    return SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1, tables[r.request_id]) for r in reqs])


def _decode_logits(model: LlamaForCausalLM, config: ModelArchConfig, dtype: torch.dtype, rows: int, fused: bool):
    runner = ModelRunner(model, config, num_blocks=16 * rows, block_size=BLOCK_SIZE, dtype=dtype)
    step = _prefill_then_decode(runner, _requests(rows))
    model.model.fused_decode = fused
    try:
        calls = []
        real = FusedDecoder.run
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(FusedDecoder, "run", lambda self, *a: calls.append(1) or real(self, *a))
            _, logits = runner.compute_logits(step)
        assert bool(calls) == fused, "the fused path must run exactly when asked"
        return logits
    finally:
        model.model.fused_decode = True


# (dtype, quantization, tolerance as a fraction of the largest logit):
# float32 differs only in summation order; bfloat16 in where the element-wise
# steps round (the fused layer keeps float32 inside each); the int4 kernel
# rounds its inputs to int8, so a one-ulp change of an input can move a
# rounding by a step.
CASES = [
    (torch.float32, None, 1e-5),
    (torch.bfloat16, None, 2**-5),
    (torch.float32, "int8", 1e-5),
    (torch.bfloat16, "int8", 2**-5),
    (torch.float32, "int4", 2**-5),
]


@pytest.mark.parametrize(("dtype", "quantization", "tolerance"), CASES)
@pytest.mark.parametrize("rows", [1, 3, FUSED_MAX_ROWS])
def test_fused_decode_matches_the_per_op_path(dtype, quantization, tolerance, rows):
    config = _config()
    model = _model(config, dtype)
    if quantization:
        quantize_model(model, quantization, 32)
    fused = _decode_logits(model, config, dtype, rows, fused=True)
    per_op = _decode_logits(model, config, dtype, rows, fused=False)
    assert fused.shape == (rows, VOCAB)
    assert (fused - per_op).abs().max() <= tolerance * per_op.abs().max()
    if dtype == torch.float32 and quantization != "int4":
        assert torch.equal(fused.argmax(-1), per_op.argmax(-1))


def test_qkv_bias_is_added():
    config = _config(attention_bias=True)
    model = _model(config)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    fused = _decode_logits(model, config, torch.float32, 2, fused=True)
    per_op = _decode_logits(model, config, torch.float32, 2, fused=False)
    assert (fused - per_op).abs().max() <= 1e-5 * per_op.abs().max()


def test_steps_the_kernel_does_not_take_run_per_op():
    config = _config()
    model = _model(config)
    # More rows than FUSED_MAX_ROWS: per-op, and the logits still match.
    many = _decode_logits(model, config, torch.float32, FUSED_MAX_ROWS + 1, fused=False)
    assert many.shape == (FUSED_MAX_ROWS + 1, VOCAB)
    runner = ModelRunner(model, config, num_blocks=48, block_size=BLOCK_SIZE, dtype=torch.float32)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FusedDecoder, "run", lambda self, *a: calls.append(1))
        reqs = _requests(2)
        decode = _prefill_then_decode(runner, reqs)
        # A prefill chunk beside the decodes: per-op.
        extra = Request("p", [1, 2, 3, 4, 5], SamplingParams())
        runner.compute_logits(SchedulerOutput([*decode.scheduled, ScheduledRequest(extra, 0, 5, [40, 41])]))
        mp.setattr(fused_decode, "FUSED_MAX_ROWS", 1)
        runner.compute_logits(decode)  # two decodes over a limit of one: per-op
    assert calls == []


def test_layers_the_kernel_cannot_take_keep_the_per_op_path():
    config = _config()
    model = _model(config)
    assert FusedDecoder.build(model.model.layers, 1e-6, torch.float32) is not None
    assert FusedDecoder.build(model.model.layers, 1e-6, torch.float16) is None
    # A linear layer of a type the kernel does not know.
    model.model.layers[1].mlp.down_proj = nn.Linear(96, 64, bias=False)
    assert FusedDecoder.build(model.model.layers, 1e-6, torch.float32) is None
    # An o_proj bias (the kernel adds only q/k/v biases).
    model = _model(config)
    model.model.layers[0].self_attn.o_proj.bias = nn.Parameter(torch.zeros(64))
    assert FusedDecoder.build(model.model.layers, 1e-6, torch.float32) is None
