"""Reading a GGUF file: its metadata as a ``ModelArchConfig``, its tensors under
Hugging Face names and layouts, and its tokenizer.

The file is memory-mapped and its header read by ``gguf_file.GGUFFile``; tensors are dequantized one
at a time as ``weights()`` is iterated.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from inferd.models.gguf_file import GGUFFile, GGUFTensor

from inferd.models.config import ModelArchConfig
from inferd.models.gguf_dequant import DEQUANTIZABLE_TYPES, dequantize, unpermute_rows
from inferd.models.gguf_tokenizer import tokenizer_from_gguf
from inferd.tokenizer import Tokenizer

# general.architecture -> HF architecture. Mistral files say "llama" too: the
# architectures are the same apart from a sliding window that llama.cpp ignores.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp permuted q/k rows for its rotary layout in these architectures only.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class RawTensor:
    """A tensor's stored data, before dequantization."""

    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # HF order, e.g. (out_features, in_features)
    # (rows, bytes per row) uint8 for block-quantized types, else the values;
    # q/k rows already un-permuted. May be a read-only view of the file.
    data: np.ndarray


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if it has none."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        hf_part = _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{hf_part}.{kind}" if hf_part else None
    base, _, kind = gguf_name.rpartition(".")
    hf_base = _TOP_LEVEL_NAMES.get(base)
    return f"{hf_base}.{kind}" if hf_base and kind in ("weight", "bias") else None


class GGUFCheckpoint:
    """An open GGUF file. Every problem with it is a ``ValueError`` naming it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = GGUFFile(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a valid GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from e
        self._arch = self._meta_required("general.architecture")
        if self._arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(sorted(GGUF_ARCHITECTURES))
            raise ValueError(f"{path}: GGUF architecture {self._arch!r} is not supported (supported: {supported})")
        self._tensors = self._index_tensors()
        self.config = self._build_config()

    def meta(self, key: str) -> Any:
        """A metadata value as plain Python (str, int, float, bool, list), or None."""
        return self._file.fields.get(key)

    def _meta_required(self, key: str) -> Any:
        value = self.meta(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return value

    def _optional_int(self, key: str) -> int | None:
        value = self.meta(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{self.path}: GGUF metadata {key!r} must be an integer, got {value!r}")
        return value

    def _int(self, key: str, default: int | None = None) -> int:
        """An integer metadata value; required unless a default is given."""
        value = self._optional_int(key)
        if value is not None:
            return value
        if default is None:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return default

    def _index_tensors(self) -> dict[str, GGUFTensor]:
        file_size = len(self._file.data)
        tensors: dict[str, GGUFTensor] = {}
        for t in self._file.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                raise ValueError(f"{self.path}: tensor {t.name!r} has no Hugging Face equivalent")
            if t.tensor_type not in DEQUANTIZABLE_TYPES:
                supported = ", ".join(q.name for q in DEQUANTIZABLE_TYPES)
                raise ValueError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                    f"dequantized (supported: {supported})"
                )
            block_size, type_size = GGML_QUANT_SIZES[t.tensor_type]
            if int(t.shape[0]) % block_size:
                raise ValueError(f"{self.path}: tensor {t.name!r} rows are not whole {t.tensor_type.name} blocks")
            expected = t.n_elements // block_size * type_size
            if t.data.nbytes != expected or t.data_offset + expected > file_size:
                raise ValueError(f"{self.path}: tensor {t.name!r} data is truncated (file cut short?)")
            tensors[name] = t
        return tensors

    def _build_config(self) -> ModelArchConfig:
        p = f"{self._arch}."
        heads = self._int(p + "attention.head_count")
        hidden = self._int(p + "embedding_length")
        if heads <= 0:
            raise ValueError(f"{self.path}: GGUF metadata {p}attention.head_count must be positive, got {heads}")
        head_dim = (
            self._optional_int(p + "attention.key_length")
            or self._optional_int(p + "rope.dimension_count")
            or hidden // heads
        )
        embed = self._tensors.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{self.path}: tensor 'token_embd.weight' is missing")
        # GGUF dims are fastest-first: token_embd is (hidden, vocab).
        vocab = int(embed.shape[1])
        tokens = self.meta("tokenizer.ggml.tokens")
        stated_vocab = self._optional_int(p + "vocab_size") or (len(tokens) if tokens else vocab)
        if stated_vocab != vocab:
            raise ValueError(f"{self.path}: vocab_size {stated_vocab} does not match token_embd's {vocab} rows")
        q = self._tensors.get("model.layers.0.self_attn.q_proj.weight")
        if q is not None and int(q.shape[1]) != heads * head_dim:
            raise ValueError(f"{self.path}: attn_q has {int(q.shape[1])} rows, not {heads} heads x {head_dim}")
        try:
            return ModelArchConfig(
                architecture=GGUF_ARCHITECTURES[self._arch],
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=self._int(p + "feed_forward_length"),
                num_hidden_layers=self._int(p + "block_count"),
                num_attention_heads=heads,
                num_key_value_heads=self._int(p + "attention.head_count_kv", heads),
                head_dim=head_dim,
                rms_norm_eps=float(self.meta(p + "attention.layer_norm_rms_epsilon") or 1e-6),
                rope_theta=float(self.meta(p + "rope.freq_base") or 10000.0),
                rope_scaling=self._rope_scaling(p),
                max_position_embeddings=self._int(p + "context_length", 2048),
                tie_word_embeddings="lm_head.weight" not in self._tensors,
                attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
                bos_token_id=self._optional_int("tokenizer.ggml.bos_token_id"),
                eos_token_id=self._optional_int("tokenizer.ggml.eos_token_id"),
            )
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from e

    def _rope_scaling(self, p: str) -> dict[str, Any] | None:
        kind = self.meta(p + "rope.scaling.type")
        if kind in (None, "none"):
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._meta_required(p + "rope.scaling.factor"))}
        original = self.meta(p + "rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def weight_names(self) -> list[str]:
        return list(self._tensors)

    def raw_tensor(self, name: str) -> RawTensor:
        """The stored blocks of the tensor HF calls ``name`` (for loading quantized layers)."""
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        data = t.data
        n_head = self._permuted_heads(name)
        if n_head is not None:
            data = unpermute_rows(data, n_head)
        return RawTensor(t.tensor_type, tuple(reversed(t.shape)), data)

    def _permuted_heads(self, name: str) -> int | None:
        if self._arch not in _PERMUTED_ARCHITECTURES:
            return None
        if ".self_attn.q_proj." in name:
            return self.config.num_attention_heads
        if ".self_attn.k_proj." in name:
            return self.config.num_key_value_heads
        return None

    def weights(self, dtype: torch.dtype = torch.float32, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._tensors:
            if name in skip:
                continue
            raw = self.raw_tensor(name)
            yield name, dequantize(raw.data, raw.qtype, raw.shape, dtype)

    def tokenizer(self) -> Tokenizer:
        name = self.meta("general.name") or self.path.stem
        return tokenizer_from_gguf(self.meta, str(self.path), name=str(name))
