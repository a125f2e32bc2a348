"""Fixtures for the checkpoint-loading tests: small GGUF files written on the
spot, and the default model loaded once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest

from inferd.models.gguf_tokenizer import byte_alphabet

# A tiny Llama: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, ffn 96.
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
TINY_CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The byte alphabet, the control tokens, then tokens the merges build.
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TINY_TOKENS = [*byte_alphabet().values(), *TINY_CONTROL_TOKENS, *(m.replace(" ", "") for m in TINY_MERGES)]
TINY_VOCAB = len(TINY_TOKENS)
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (what the loader must undo)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights of the tiny Llama under GGUF names, HF layout (rows = out features)."""
    rng = np.random.default_rng(seed)
    h, f, d = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    kv = TINY["kv_heads"] * d
    shapes = {"token_embd.weight": (TINY_VOCAB, h), "output_norm.weight": (h,), "output.weight": (TINY_VOCAB, h)}
    for i in range(TINY["layers"]):
        shapes |= {
            f"blk.{i}.attn_q.weight": (h, h),
            f"blk.{i}.attn_k.weight": (kv, h),
            f"blk.{i}.attn_v.weight": (kv, h),
            f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_gate.weight": (f, h),
            f"blk.{i}.ffn_up.weight": (f, h),
            f"blk.{i}.ffn_down.weight": (h, f),
            f"blk.{i}.attn_norm.weight": (h,),
            f"blk.{i}.ffn_norm.weight": (h,),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
    *,
    arch: str = "llama",
    metadata: bool = True,
    tokenizer: bool = True,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write a GGUF with the tiny model's metadata and ``tensors`` (float32 data,
    stored as the given type; permute q/k beforehand where that is wanted)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata:
        writer.add_block_count(TINY["layers"])
        writer.add_context_length(256)
        writer.add_embedding_length(TINY["hidden"])
        writer.add_feed_forward_length(TINY["ffn"])
        writer.add_head_count(TINY["heads"])
        writer.add_head_count_kv(TINY["kv_heads"])
        writer.add_rope_freq_base(50000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(TINY_TOKENS)
        types = [3 if t in TINY_CONTROL_TOKENS else 1 for t in TINY_TOKENS]
        writer.add_token_types(types)
        writer.add_token_merges(TINY_MERGES)
        writer.add_bos_token_id(TINY_TOKENS.index("<|im_start|>"))
        writer.add_eos_token_id(TINY_TOKENS.index("<|im_end|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(TINY_TEMPLATE)
    if extra is not None:
        extra(writer)
    for name, (data, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, gguf.quants.quantize(data, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def all_f32(weights: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, Any]]:
    return {name: (w, gguf.GGMLQuantizationType.F32) for name, w in weights.items()}


@pytest.fixture(scope="session")
def tiny_gguf() -> SimpleNamespace:
    """The tiny-GGUF helpers and constants, for tests to build files from."""
    return SimpleNamespace(
        write=write_gguf,
        weights=tiny_llama_weights,
        all_f32=all_f32,
        permute=permute_like_llama_cpp,
        dims=TINY,
        tokens=TINY_TOKENS,
        template=TINY_TEMPLATE,
    )


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path):
    from inferd.models.loader import load_checkpoint

    return load_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_model_path):
    """transformers' own tokenizer for the default GGUF: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
