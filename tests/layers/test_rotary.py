from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama

from inferd.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

HEAD_DIM = 32


def _hf_config(rope_scaling: dict | None, theta: float = 10000.0) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=4096,
    )


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


def test_default_frequencies_match_transformers() -> None:
    config = _hf_config(None, theta=100000.0)
    expected, _ = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    got = compute_inv_freq(HEAD_DIM, 100000.0)
    assert got.dtype == torch.float32
    assert got.shape == (HEAD_DIM // 2,)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "scaling", [{"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["linear", "llama3"]
)
def test_scaled_frequencies_match_transformers(scaling: dict) -> None:
    config = _hf_config(dict(scaling), theta=500000.0)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    got = compute_inv_freq(HEAD_DIM, 500000.0, scaling, 4096)
    assert attention_factor == 1.0
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    # Not the unscaled frequencies: the scaling really did something.
    assert (got - compute_inv_freq(HEAD_DIM, 500000.0)).abs().max() > 1e-3


def test_llama3_keeps_high_and_divides_low_frequencies() -> None:
    base = compute_inv_freq(HEAD_DIM, 500000.0)
    got = compute_inv_freq(HEAD_DIM, 500000.0, LLAMA3, 4096)
    # Wavelength 2*pi/base[0] = 6.3 < 512/4: kept. The last is far above 512: / 8.
    assert got[0] == base[0]
    assert torch.allclose(got[-1], base[-1] / 8.0, rtol=1e-6, atol=0)


def test_rotation_matches_transformers() -> None:
    config = _hf_config({"rope_type": "linear", "factor": 2.0})
    hf_rotary = modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 2, 7, 300, 5, 4095])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(positions), 3, HEAD_DIM, generator=gen)  # (T, N, D)

    hf_cos, hf_sin = hf_rotary(x, positions[None])  # (1, T, D)
    # HF rotates (B, N, T, D); ours is (T, N, D).
    hf_q, _ = modeling_llama.apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin
    )
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, {"rope_type": "linear", "factor": 2.0}, 4096)
    cos, sin = rotary(positions, torch.float32)
    assert cos.shape == sin.shape == (len(positions), 1, HEAD_DIM)
    got = apply_rotary(x, cos, sin)
    assert (got - hf_q[0].transpose(0, 1)).abs().max() <= 1e-5
    # Position 0 is the identity rotation.
    assert torch.equal(got[0], x[0])


def test_frequencies_stay_float32_after_casting_the_module() -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    cos, sin = rotary(torch.tensor([3]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16


def test_unsupported_or_incomplete_scaling_is_rejected() -> None:
    unsupported = r"rope_scaling type 'yarn' is not supported \(supported: linear, llama3\)"
    with pytest.raises(ValueError, match=unsupported):
        compute_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling of type 'llama3' needs 'low_freq_factor'"):
        compute_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="head_dim must be a positive even number, got 7"):
        compute_inv_freq(7, 10000.0)
