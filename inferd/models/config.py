"""The architecture of a decoder model, in Hugging Face ``config.json`` terms.

Both loaders (HF directory and GGUF) produce one of these, so model code
never knows where its weights came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM", the key into the model registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF's rope_scaling dict: {"rope_type": "linear"|"llama3", "factor": ..., ...} or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # q/k/v projections carry a bias (Qwen2).
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "model config num_attention_heads must be a multiple of num_key_value_heads, "
                f"got {self.num_attention_heads} and {self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelArchConfig:
        """Build from the contents of a Hugging Face ``config.json``."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("model config has no 'architectures' entry")
        arch = archs[0]
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            config = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(d)),
                rope_scaling=_rope_scaling(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing required field {e.args[0]!r}") from None
        return config


def _rope_theta(d: dict[str, Any]) -> float:
    # transformers >= 5 moves rope_theta into "rope_parameters".
    params = d.get("rope_parameters") or {}
    return d.get("rope_theta") or params.get("rope_theta") or 10000.0


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    scaling["rope_type"] = kind
    return scaling
