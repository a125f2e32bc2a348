from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from inferd.models.gguf_loader import GGUFCheckpoint, hf_tensor_name
from inferd.models.loader import load_checkpoint

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def default_weights(default_checkpoint):
    return dict(default_checkpoint.weights(torch.float32))


@pytest.fixture(scope="module")
def default_reader(default_model_path):
    return gguf.GGUFReader(default_model_path)


def test_default_model_config(default_checkpoint):
    c = default_checkpoint.config
    assert default_checkpoint.format == "gguf"
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM",
        30,
        576,
        1536,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.rms_norm_eps, c.rope_scaling, c.max_position_embeddings) == (100000.0, 1e-5, None, 8192)
    assert c.tie_word_embeddings is True and c.attention_bias is False
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)


def test_default_model_names_follow_hugging_face(default_checkpoint, default_reader):
    names = default_checkpoint.weight_names()
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    # gguf's own HF -> GGUF table agrees with every name we produced.
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    stored = {t.name for t in default_reader.tensors}
    assert {table.get_name(n, try_suffixes=(".weight", ".bias")) for n in names} == stored


def test_default_model_weights_equal_transformers(default_weights, hf_model):
    """transformers' own GGUF loading (its dequantization and un-permutation) is the reference."""
    reference = hf_model.state_dict()
    assert set(reference) - set(default_weights) == {"lm_head.weight"}  # tied to the embedding
    for name, ours in default_weights.items():
        assert ours.dtype == torch.float32
        assert torch.equal(ours, reference[name]), name
    assert default_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert default_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert default_weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert default_weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_weights_convert_dtype(default_checkpoint, default_weights):
    name, first = next(default_checkpoint.weights(torch.bfloat16))
    assert first.dtype == torch.bfloat16
    assert torch.equal(first, default_weights[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="floating-point"):
        default_checkpoint.weights(torch.int8)


def test_raw_tensor_gives_unpermuted_quantized_blocks(default_checkpoint, default_weights):
    name = "model.layers.0.self_attn.k_proj.weight"
    raw = default_checkpoint.source.raw_tensor(name)
    assert raw.qtype == Q.Q4_1 and raw.shape == (192, 576) and raw.data.shape == (192, 360)
    dequantized = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.qtype))
    assert torch.equal(dequantized, default_weights[name])
    with pytest.raises(KeyError):
        default_checkpoint.source.raw_tensor("lm_head.weight")


def test_every_type_dequantizes_and_q_k_are_unpermuted(tiny_gguf, tmp_path):
    weights = tiny_gguf.weights()
    heads, kv_heads = tiny_gguf.dims["heads"], tiny_gguf.dims["kv_heads"]
    types = {
        "token_embd.weight": Q.Q8_0,
        "output.weight": Q.Q4_1,
        "blk.0.attn_q.weight": Q.F32,
        "blk.0.attn_k.weight": Q.F16,
        "blk.0.attn_v.weight": Q.BF16,
        "blk.0.attn_output.weight": Q.Q8_0,
        "blk.0.ffn_gate.weight": Q.Q4_0,
        "blk.0.ffn_up.weight": Q.Q4_1,
        "blk.1.attn_q.weight": Q.Q4_0,
        "blk.1.attn_k.weight": Q.Q8_0,
        "blk.1.ffn_down.weight": Q.BF16,
    }
    stored = {}
    for name, w in weights.items():
        if ".attn_q." in name:
            w = tiny_gguf.permute(w, heads)
        elif ".attn_k." in name:
            w = tiny_gguf.permute(w, kv_heads)
        stored[name] = (w, types.get(name, Q.F32))
    checkpoint = load_checkpoint(tiny_gguf.write(tmp_path / "tiny.gguf", stored))
    loaded = dict(checkpoint.weights())
    assert len(loaded) == len(weights) and checkpoint.config.tie_word_embeddings is False
    for gguf_name, (data, qtype) in stored.items():
        ours = loaded[hf_tensor_name(gguf_name)]
        reference = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).astype(np.float32)
        # What the file holds is llama.cpp's order: permuting ours again must give it back.
        if ".attn_q." in gguf_name:
            ours = torch.from_numpy(tiny_gguf.permute(ours.numpy(), heads))
        elif ".attn_k." in gguf_name:
            ours = torch.from_numpy(tiny_gguf.permute(ours.numpy(), kv_heads))
        assert torch.equal(ours, torch.from_numpy(reference)), gguf_name
    # Float32 q/k come back exactly as they were before llama.cpp's permutation.
    original_q = torch.from_numpy(weights["blk.0.attn_q.weight"])
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], original_q)


def test_tiny_config_and_tied_embeddings(tiny_gguf, tmp_path):
    weights = tiny_gguf.weights()
    del weights["output.weight"]
    checkpoint = load_checkpoint(tiny_gguf.write(tmp_path / "tied.gguf", tiny_gguf.all_f32(weights)))
    c = checkpoint.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads) == (2, 64, 96, 4)
    assert (c.num_key_value_heads, c.head_dim, c.vocab_size, c.rope_theta) == (2, 16, len(tiny_gguf.tokens), 50000.0)
    assert c.tie_word_embeddings is True and "lm_head.weight" not in checkpoint.weight_names()


def test_qwen2_keeps_q_k_order_and_has_biases(tiny_gguf, tmp_path):
    weights = tiny_gguf.weights()
    rng = np.random.default_rng(3)
    for i in range(2):
        for part, rows in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32)):
            weights[f"blk.{i}.{part}.bias"] = rng.standard_normal(rows).astype(np.float32)
    checkpoint = load_checkpoint(tiny_gguf.write(tmp_path / "qwen.gguf", tiny_gguf.all_f32(weights), arch="qwen2"))
    assert checkpoint.config.architecture == "Qwen2ForCausalLM" and checkpoint.config.attention_bias is True
    loaded = dict(checkpoint.weights())
    for name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.0.attn_q.bias", "blk.0.attn_k.bias"):
        assert torch.equal(loaded[hf_tensor_name(name)], torch.from_numpy(weights[name])), name


def test_rope_scaling_metadata(tiny_gguf, tmp_path):
    def scaling(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    path = tiny_gguf.write(tmp_path / "rope.gguf", tiny_gguf.all_f32(tiny_gguf.weights()), extra=scaling)
    assert GGUFCheckpoint(path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_hf_tensor_names():
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    assert hf_tensor_name("blk.0.attn_qkv.weight") is None


# --- errors: each a ValueError naming the file -------------------------------------------


def _assert_load_fails(path, match):
    with pytest.raises(ValueError, match=match) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_missing_path(tmp_path):
    _assert_load_fails(tmp_path / "nope.gguf", "does not exist")


@pytest.mark.parametrize("fraction", [0.5, 0.01])
def test_truncated_file(tiny_gguf, tmp_path, fraction):
    path = tiny_gguf.write(tmp_path / "cut.gguf", tiny_gguf.all_f32(tiny_gguf.weights()))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    _assert_load_fails(path, "truncated|not a valid GGUF")


def test_random_bytes_and_bad_magic(tmp_path):
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_load_fails(noise, "not a valid GGUF")
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + bytes(64))
    _assert_load_fails(magic, "not a valid GGUF.*magic")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _assert_load_fails(empty, "not a valid GGUF")


def test_tensor_type_that_cannot_be_dequantized(tiny_gguf, tmp_path):
    def k_quant(writer):
        # Q4_K: 144 bytes per 256 values; the type is rejected before shapes matter.
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((96, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)

    weights = tiny_gguf.weights()
    del weights["blk.0.ffn_up.weight"]
    path = tiny_gguf.write(tmp_path / "k.gguf", tiny_gguf.all_f32(weights), extra=k_quant)
    _assert_load_fails(path, "type Q4_K, which cannot be dequantized")


def test_unsupported_architecture(tiny_gguf, tmp_path):
    path = tiny_gguf.write(tmp_path / "gpt2.gguf", tiny_gguf.all_f32(tiny_gguf.weights()), arch="gpt2")
    _assert_load_fails(path, "architecture 'gpt2' is not supported.*llama.*qwen2")
    llama = tiny_gguf.write(tmp_path / "llama.gguf", tiny_gguf.all_f32(tiny_gguf.weights()))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM' is not supported \(supported: Qwen2ForCausalLM\)"):
        load_checkpoint(llama, supported_architectures=("Qwen2ForCausalLM",))


def test_missing_tokenizer(tiny_gguf, tmp_path):
    path = tiny_gguf.write(tmp_path / "notok.gguf", tiny_gguf.all_f32(tiny_gguf.weights()), tokenizer=False)
    _assert_load_fails(path, "no tokenizer")


def test_missing_metadata(tiny_gguf, tmp_path):
    path = tiny_gguf.write(tmp_path / "nometa.gguf", tiny_gguf.all_f32(tiny_gguf.weights()), metadata=False)
    _assert_load_fails(path, "'llama.attention.head_count' is missing")


def test_tensor_without_hugging_face_name(tiny_gguf, tmp_path):
    weights = tiny_gguf.weights() | {"rope_freqs.weight": np.ones(8, np.float32)}
    path = tiny_gguf.write(tmp_path / "extra.gguf", tiny_gguf.all_f32(weights))
    _assert_load_fails(path, "'rope_freqs.weight' has no Hugging Face equivalent")


def test_not_a_checkpoint(tmp_path):
    other = tmp_path / "model.bin"
    other.write_bytes(b"\x00" * 16)
    _assert_load_fails(other, "expected a .gguf file or a directory with config.json")
