from __future__ import annotations

import json
import shutil

import pytest
import torch

from inferd.models.loader import load_checkpoint

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
TEXTS = ["Hello, world!", "12345 3.14", "你好，世界 🙂👍🏽", "<|im_start|>user\nHi<|im_end|>", "  code():\n\treturn"]


def _save_model(path, tied: bool = False, qwen: bool = False, **save_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if qwen:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA, tie_word_embeddings=tied))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tied))
    model.save_pretrained(path, **save_kwargs)
    return model.state_dict()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_gguf_tokenizer):
    """A tiny random Llama with the default model's tokenizer beside it, as
    transformers saves them; generation_config.json lists a second EOS."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    state = _save_model(path)
    hf_gguf_tokenizer.save_pretrained(path)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [2, 0]}))
    return path, state


@pytest.fixture
def hf_copy(hf_dir, tmp_path):
    """A scratch copy of hf_dir that a test may break."""
    return shutil.copytree(hf_dir[0], tmp_path / "copy")


def test_weights_equal_state_dict(hf_dir):
    path, state = hf_dir
    checkpoint = load_checkpoint(path)
    loaded = dict(checkpoint.weights())
    assert checkpoint.format == "hf" and set(loaded) == set(state) and "lm_head.weight" in loaded
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor), name
    half = dict(checkpoint.weights(torch.bfloat16))
    assert torch.equal(half["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))


def test_config(hf_dir):
    c = load_checkpoint(hf_dir[0]).config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("LlamaForCausalLM", 128, 64, 96)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 16)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (50000.0, 1e-5, 256)
    assert c.tie_word_embeddings is False and c.attention_bias is False


def test_tokenizer_matches_transformers(hf_dir, hf_gguf_tokenizer):
    tok = load_checkpoint(hf_dir[0]).tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_gguf_tokenizer.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    # <|im_end|> from the tokenizer and config.json, <|endoftext|> from generation_config.json.
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.all_special_ids == frozenset(range(17))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages) == hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chat_template_from_tokenizer_config(hf_copy):
    (hf_copy / "chat_template.jinja").unlink()
    config_file = hf_copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"chat_template": "inline {{ messages[0].content }}"}))
    assert load_checkpoint(hf_copy).tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "inline x"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    config_file.write_text(json.dumps(config | {"chat_template": named}))
    assert load_checkpoint(hf_copy).tokenizer.chat_template == "default"


def test_added_tokens_and_special_tokens_map(hf_copy):
    config_file = hf_copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["eos_token"]
    config["added_tokens_decoder"] = {"49152": {"content": "<extra>", "special": True, "normalized": False}}
    config_file.write_text(json.dumps(config))
    (hf_copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = load_checkpoint(hf_copy).tokenizer
    assert tok.token_to_id("<extra>") == 49152 and 49152 in tok.all_special_ids
    assert tok.encode("a<extra>") == [tok.token_to_id("a"), 49152]
    assert tok.eos_token == "<|endoftext|>"


def test_tied_checkpoint_has_no_lm_head(tmp_path, hf_dir):
    path = tmp_path / "tied"
    state = _save_model(path, tied=True)
    shutil.copy(hf_dir[0] / "tokenizer.json", path)
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.tie_word_embeddings is True
    assert "lm_head.weight" not in checkpoint.weight_names()
    assert set(checkpoint.weight_names()) == set(state) - {"lm_head.weight"}


def test_sharded_checkpoint_follows_index(tmp_path, hf_dir):
    path = tmp_path / "sharded"
    state = _save_model(path, max_shard_size="20KB")
    shutil.copy(hf_dir[0] / "tokenizer.json", path)
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    # A stray file the index does not name is not read.
    shutil.copy(hf_dir[0] / "model.safetensors", path / "stray.safetensors")
    loaded = dict(load_checkpoint(path).weights())
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


def test_qwen2_biases(tmp_path, hf_dir):
    path = tmp_path / "qwen"
    state = _save_model(path, qwen=True)
    shutil.copy(hf_dir[0] / "tokenizer.json", path)
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.architecture == "Qwen2ForCausalLM" and checkpoint.config.attention_bias is True
    loaded = dict(checkpoint.weights())
    assert torch.equal(loaded["model.layers.1.self_attn.k_proj.bias"], state["model.layers.1.self_attn.k_proj.bias"])


# --- errors: each a ValueError naming the file ---------------------------------------------


def _assert_load_fails(path, file, match):
    with pytest.raises(ValueError, match=match) as info:
        load_checkpoint(path)
    assert str(file) in str(info.value)


def test_directory_without_config(tmp_path):
    _assert_load_fails(tmp_path, tmp_path, "has no config.json")


def test_config_not_json(hf_copy):
    (hf_copy / "config.json").write_text("{not json")
    _assert_load_fails(hf_copy, hf_copy / "config.json", "not valid JSON")


def test_unsupported_architecture(hf_copy):
    (hf_copy / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _assert_load_fails(
        hf_copy,
        hf_copy / "config.json",
        r"'GPT2LMHeadModel' is not supported \(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM\)",
    )


def test_config_missing_field(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    del config["hidden_size"]
    (hf_copy / "config.json").write_text(json.dumps(config))
    _assert_load_fails(hf_copy, hf_copy / "config.json", "missing required field 'hidden_size'")


def test_quantized_checkpoint(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    _assert_load_fails(hf_copy, hf_copy / "config.json", "quantized")


def test_no_safetensors(hf_copy):
    (hf_copy / "model.safetensors").unlink()
    _assert_load_fails(hf_copy, hf_copy, r"no \*.safetensors weight files")


@pytest.mark.parametrize("damage", ["half", "noise", "empty"])
def test_corrupt_safetensors(hf_copy, damage):
    weights = hf_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"half": data[: len(data) // 2], "noise": bytes(range(256)) * 8, "empty": b""}[damage])
    _assert_load_fails(hf_copy, weights, "not a valid safetensors file")


def test_index_names_missing_shard(hf_copy):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_load_fails(hf_copy, hf_copy / "model-00002-of-00002.safetensors", "weight file is missing")


def test_missing_tokenizer(hf_copy):
    (hf_copy / "tokenizer.json").unlink()
    _assert_load_fails(hf_copy, hf_copy, "no tokenizer.json")


def test_corrupt_tokenizer(hf_copy):
    (hf_copy / "tokenizer.json").write_text('{"model": 1}')
    _assert_load_fails(hf_copy, hf_copy / "tokenizer.json", "not a valid tokenizer file")


def test_bad_generation_config(hf_copy):
    (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    _assert_load_fails(hf_copy, hf_copy / "generation_config.json", "eos_token_id must be an integer")
