"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Parameter names are Hugging Face's except for two fused projections:
``qkv_proj`` stacks ``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj``
stacks ``gate_proj``/``up_proj``; ``load_weights`` maps the checkpoint names
onto them with ``packed_modules_mapping``. Mistral's sliding window is not
applied: attention is always over the whole context.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.layers.attention import AttentionMetadata, PagedAttention
from inferd.layers.fused_decode import FusedDecoder
from inferd.layers.linear import Linear, MergedLinear, dense_linear
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RotaryEmbedding, apply_rotary
from inferd.models.config import ModelArchConfig

KVCache = tuple[Tensor, Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5
        )

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 KVH) D)
        # q and k are adjacent in qkv, so one rotation covers both.
        qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta)  # (T, H D)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.intermediate_size = size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False
        )
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I)
        size = self.intermediate_size
        return self.down_proj(F.silu(gate_up[:, :size]) * gate_up[:, size:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """Returns this layer's output and the residual stream before it; the
        next norm adds them, so each add happens once."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        self.rms_norm_eps = config.rms_norm_eps
        # Decode-only steps of a few rows run each layer in one C call
        # (inferd.layers.fused_decode); False keeps the per-op path.
        self.fused_decode = True
        self._fused: FusedDecoder | None = None
        self._fused_built = False

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary_emb(positions, x.dtype)
        fused = self._fused_decoder(x) if self.fused_decode and FusedDecoder.applies(x, meta) else None
        if fused is not None:
            x, residual = fused.run(x, cos, sin, kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def _fused_decoder(self, x: Tensor) -> FusedDecoder | None:
        # Built on first use, after loading and quantization have settled
        # the modules and their weights.
        if not self._fused_built:
            self._fused = FusedDecoder.build(self.layers, self.rms_norm_eps, x.dtype)
            self._fused_built = True
        return self._fused


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (fused module name, shard)
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q_proj"),
        "k_proj": ("qkv_proj", "k_proj"),
        "v_proj": ("qkv_proj", "v_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied: the output projection is the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        """``input_ids``/``positions`` (T,) flat over the batch -> hidden (T, hidden)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, hidden) -> (N, vocab) float32."""
        if self.lm_head is None:
            return dense_linear(hidden, self.model.embed_tokens.weight).float()
        # A module, not its weight: a quantized head (inferd.models.quantize) has none.
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], deferred: Collection[str] = ()) -> None:
        """Copies Hugging Face-named tensors into the parameters.

        ``deferred`` names checkpoint tensors the caller fills another way
        (quantized layers built from the file): they may be absent, and their
        parameters stay unwritten, so their memory is never committed.
        Raises ValueError naming unknown checkpoint tensors, missing
        parameters (or fused shards), and shape mismatches.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        # What each parameter needs from the checkpoint: itself, or one
        # tensor per shard when it is fused.
        parts: dict[str, set[str]] = {name: {name} for name in params}
        for module_name, module in modules.items():
            if isinstance(module, MergedLinear):
                for param_name, _ in module.named_parameters(recurse=False):
                    parts[f"{module_name}.{param_name}"] = {
                        f"{module_name}.{shard}.{param_name}" for shard in module.shards
                    }
        missing = set().union(*parts.values())
        for name in deferred:
            packed = _packed_target(name, self.packed_modules_mapping)
            missing.discard(".".join(packed) if packed else name)
        unknown: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name in params:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                missing.difference_update(parts[name])
                continue
            packed = _packed_target(name, self.packed_modules_mapping)
            module = modules.get(packed[0]) if packed else None
            if not isinstance(module, MergedLinear):
                unknown.append(name)
                continue
            fused_name, shard, param_name = packed
            module.load_shard(shard, param_name, tensor)
            missing.discard(f"{fused_name}.{shard}.{param_name}")
        if unknown:
            raise ValueError(f"checkpoint has unknown weights: {', '.join(sorted(unknown))}")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing))}")


_PARAM_NAME = re.compile(r"^(?P<parent>.*\.)?(?P<module>[^.]+)\.(?P<param>weight|bias)$")


def _packed_target(name: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str, str] | None:
    """``a.b.q_proj.weight`` -> ("a.b.qkv_proj", "q_proj", "weight")."""
    match = _PARAM_NAME.match(name)
    if match is None or match["module"] not in mapping:
        return None
    fused, shard = mapping[match["module"]]
    return f"{match['parent'] or ''}{fused}", shard, match["param"]
