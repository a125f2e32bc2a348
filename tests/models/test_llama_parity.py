"""Logit parity with transformers for the Llama family, through the runner.

Tiny random-weight transformers models are loaded into inferd's model by name,
then driven step by step the way the engine would: chunked prefill across
block boundaries with shuffled block ids, several requests per step (one
prefilling while others decode), greedy tokens appended between steps.
Every sampled logit row must match transformers' full-sequence forward.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from inferd.engine.request import Request
from inferd.engine.runner import ModelRunner
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from inferd.models.config import ModelArchConfig
from inferd.models.registry import build_model
from inferd.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 40
DECODE_STEPS = 6

_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _hf_config(name: str) -> transformers.PretrainedConfig:
    if name == "llama_linear":
        return transformers.LlamaConfig(
            **_SHAPE,
            rope_theta=5000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
    if name == "llama3":
        # original_max_position_embeddings 64 with head_dim 16 puts the
        # frequencies in all three llama3 bands (kept, smoothed, divided).
        return transformers.LlamaConfig(
            **_SHAPE,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
    if name == "mistral":
        return transformers.MistralConfig(
            **_SHAPE,
            sliding_window=None,
            tie_word_embeddings=False,
            architectures=["MistralForCausalLM"],
        )
    if name == "qwen2_tied":
        return transformers.Qwen2Config(
            **_SHAPE, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]
        )
    raise AssertionError(name)


def _hf_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # transformers' 0.02-std init makes nearly uniform logits; larger weights
    # make rotary, masking or bias mistakes show up far above the tolerance.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    return model.float().eval()


def _drive(runner: ModelRunner, prompts: dict[str, list[int]], chunks: dict[str, list[int]]):
    """Runs every prompt through its chunk sizes and then DECODE_STEPS decodes,
    all requests in the same steps; returns the requests and
    (request id, position, logits) for every sampled row."""
    rng = random.Random(7)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    requests, tables, pending = {}, {}, {}
    for rid, prompt in prompts.items():
        requests[rid] = Request(rid, prompt, SamplingParams(temperature=0.0))
        needed = -(-(len(prompt) + DECODE_STEPS + 1) // BLOCK_SIZE)
        tables[rid], free = free[:needed], free[needed:]
        pending[rid] = list(chunks[rid])
    sampled_rows = []
    num_steps = max(len(c) for c in chunks.values()) + DECODE_STEPS
    for _ in range(num_steps):
        scheduled = []
        for rid, req in requests.items():
            if req.num_output_tokens >= DECODE_STEPS:
                continue
            n = pending[rid].pop(0) if pending[rid] else 1
            scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, tables[rid]))
        # Decodes after prefills here: the runner must reorder on its own.
        scheduled.sort(key=lambda s: s.num_new_tokens == 1)
        reqs, logits = runner.compute_logits(SchedulerOutput(scheduled))
        assert logits.dtype == torch.float32
        assert logits.shape == (len(reqs), 256)
        sampling = {s.request.request_id for s in scheduled if s.samples}
        assert {r.request_id for r in reqs} == sampling
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        for req, row in zip(reqs, logits):
            sampled_rows.append((req.request_id, req.num_tokens - 1, row.clone()))
            req.append_output_token(int(row.argmax()))
    return requests, sampled_rows


@pytest.mark.parametrize("name", ["llama_linear", "llama3", "mistral", "qwen2_tied"])
def test_runner_logits_match_transformers(name: str) -> None:
    hf_config = _hf_config(name)
    hf_model = _hf_model(hf_config)
    config = ModelArchConfig.from_hf_dict(hf_config.to_dict())
    model = build_model(config, torch.float32, "cpu")
    model.load_weights(hf_model.state_dict().items())
    runner = ModelRunner(
        model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(3)
    lengths = {"a": 13, "b": 7, "c": 9}
    prompts = {
        rid: torch.randint(0, 256, (n,), generator=gen).tolist() for rid, n in lengths.items()
    }
    # a: three uneven chunks, the later ones attending to cached context;
    # b: one chunk, so it decodes while a and c still prefill; c: two chunks.
    chunks = {"a": [5, 6, 2], "b": [7], "c": [2, 7]}
    requests, sampled_rows = _drive(runner, prompts, chunks)

    assert len(sampled_rows) == 3 * DECODE_STEPS
    with torch.no_grad():
        reference = {
            rid: hf_model(torch.tensor([req.all_token_ids])).logits[0]
            for rid, req in requests.items()
        }
    worst = max((row - reference[rid][pos]).abs().max().item() for rid, pos, row in sampled_rows)
    assert worst <= 1e-4
    # The logits are far from flat, so the tolerance above is meaningful.
    assert reference["a"].std().item() > 0.5


def test_load_weights_names_unknown_and_missing() -> None:
    hf_config = _hf_config("llama_linear")
    hf_model = _hf_model(hf_config)
    config = ModelArchConfig.from_hf_dict(hf_config.to_dict())
    model = build_model(config, torch.float32, "cpu")
    state = dict(hf_model.state_dict())

    with pytest.raises(ValueError, match=r"unknown weights: model\.layers\.0\.mlp\.extra\.weight"):
        model.load_weights([*state.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])

    del state["model.layers.1.self_attn.k_proj.weight"], state["lm_head.weight"]
    with pytest.raises(ValueError) as err:
        model.load_weights(state.items())
    assert str(err.value) == (
        "checkpoint is missing weights: lm_head.weight, "
        "model.layers.1.self_attn.qkv_proj.k_proj.weight"
    )


def test_load_weights_rejects_wrong_shape() -> None:
    hf_config = _hf_config("qwen2_tied")
    config = ModelArchConfig.from_hf_dict(hf_config.to_dict())
    model = build_model(config, torch.float32, "cpu")
    weights = [("model.layers.0.self_attn.q_proj.bias", torch.zeros(8))]
    with pytest.raises(ValueError, match=r"q_proj\.bias has shape \(8,\), expected \(64,\)"):
        model.load_weights(weights)


def test_build_model_rejects_unknown_architecture() -> None:
    hf_dict = {**_hf_config("mistral").to_dict(), "architectures": ["GPT2LMHeadModel"]}
    config = ModelArchConfig.from_hf_dict(hf_dict)
    with pytest.raises(ValueError) as err:
        build_model(config, torch.float32, "cpu")
    assert str(err.value) == (
        "model architecture 'GPT2LMHeadModel' is not supported "
        "(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
    )
