"""A decode step's decoder layers in one C call (``kernels/decode_layer.c``).

At a few rows a Llama-family decoder layer is about thirty small tensor
operations, and each PyTorch call costs microseconds of dispatch on a CPU:
at batch 1 more than reading the layer's weights. ``FusedDecoder`` runs a
step of decodes only (no prefill chunk, no draft tokens) layer by layer
in one parallel region of the compiled kernel, with the same weights, cache and metadata as
the per-op path, and the same result up to float32 summation order.

Built once per model from its layers' modules (float, int8 or int4 linear
layers); the weights must stay where they are afterwards, as they do once
a model is loaded. ``FusedDecoder.build`` returns None where a layer does
not fit (another linear type, a bias outside q/k/v, mixed dtypes), and the
model keeps the per-op path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from inferd.layers.attention import AttentionMetadata
from inferd.layers.cpu_kernels import DTYPE_CODES, decode_layers, kernels_available, weight_kind
from inferd.layers.linear import Linear
from inferd.layers.quant import Int4Linear, Int8Linear

# Rows up to which a decode step runs fused. Measured on the default model
# (benchmarks/results/fused_decode.json, 2 cores): fused against per-op at 8
# rows 151 vs 99 tok/s (float32) and 273 vs 185 (int4), at 16 rows 149 vs 98
# and 239 vs 203; at 32 rows float32 lost (182 vs 201).
FUSED_MAX_ROWS = 16


class LinearWeight(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("kind", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("out_features", ctypes.c_int32),
        ("in_features", ctypes.c_int32),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("qkv", LinearWeight),
        ("o", LinearWeight),
        ("gate_up", LinearWeight),
        ("down", LinearWeight),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int32) for name in (
            "rows", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "dtype", "num_threads",
            "block_size", "max_blocks",
        )],
        ("num_blocks", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("cos", "sin", "slots", "tables", "seq_lens")],
    ]  # fmt: skip


def _linear_weight(module: nn.Module, dtype: torch.dtype, bias_allowed: bool) -> LinearWeight | None:
    bias = getattr(module, "bias", None)
    if bias is not None and (not bias_allowed or bias.dtype != dtype):
        return None
    if isinstance(module, Int4Linear):
        weight, scales, group = module.packed, module.scales_zeros, module.group_size
    elif isinstance(module, Int8Linear):
        weight, scales, group = module.codes, module.scales, 0
    elif isinstance(module, Linear) and module.weight.dtype == dtype:
        weight, scales, group = module.weight, None, 0
    else:
        return None
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    return LinearWeight(
        weight.data_ptr(),
        None if scales is None else scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        weight_kind(weight), group, module.out_features, module.in_features,
    )  # fmt: skip


class FusedDecoder:
    def __init__(self, layers: list[LayerWeights], step: Step) -> None:
        # The structures hold the weights' addresses; the model's modules own them.
        self.layers = (LayerWeights * len(layers))(*layers)
        self.step = step
        self._caches: list[tuple[Tensor, Tensor]] | None = None

    @classmethod
    def build(cls, decoder_layers: nn.ModuleList, rms_eps: float, dtype: torch.dtype) -> FusedDecoder | None:
        """From Llama-family decoder layers (``self_attn.qkv_proj/o_proj``,
        ``mlp.gate_up_proj/down_proj``, the two norms), or None where they
        do not fit the kernel."""
        if dtype not in DTYPE_CODES or not kernels_available():
            return None
        layers = []
        for layer in decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [
                _linear_weight(attn.qkv_proj, dtype, bias_allowed=True),
                _linear_weight(attn.o_proj, dtype, bias_allowed=False),
                _linear_weight(mlp.gate_up_proj, dtype, bias_allowed=False),
                _linear_weight(mlp.down_proj, dtype, bias_allowed=False),
            ]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if any(w is None for w in linears) or any(n.dtype != dtype or not n.is_contiguous() for n in norms):
                return None
            layers.append(LayerWeights(*linears, *(n.data_ptr() for n in norms), None, None))
        first = decoder_layers[0].self_attn
        step = Step(
            hidden=decoder_layers[0].input_layernorm.weight.shape[0],
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=decoder_layers[0].mlp.intermediate_size,
            dtype=DTYPE_CODES[dtype],
            eps=rms_eps,
            scale=first.attn.scale,
        )
        return cls(layers, step)

    @staticmethod
    def applies(x: Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is decodes only, few enough, on the CPU kernel."""
        return (
            meta.decode_kernel
            and not meta.prefills
            and len(meta.decodes) == 1
            and meta.num_decodes == x.shape[0] <= FUSED_MAX_ROWS
            and x.dtype in DTYPE_CODES
        )

    def run(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """All layers over ``x`` (T, hidden), the step's embeddings; returns
        the last layer's output and the residual stream before it, as the
        per-op layers do. ``cos``/``sin`` are RotaryEmbedding's (T, 1, D)."""
        self._bind_caches(kv_caches)
        group = meta.decodes[0]
        rows = x.shape[0]
        x = x.contiguous().clone()
        residual = torch.empty_like(x)
        cos = cos.reshape(rows, -1).float().contiguous()
        sin = sin.reshape(rows, -1).float().contiguous()
        tables = group.block_ids.view(rows, -1)
        k_cache = kv_caches[0][0]
        step = self.step
        step.rows = rows
        step.num_threads = torch.get_num_threads()
        step.block_size = k_cache.shape[1]
        step.max_blocks = tables.shape[1]
        step.num_blocks = k_cache.shape[0]
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slots = meta.slot_mapping.data_ptr()
        step.tables, step.seq_lens = tables.data_ptr(), group.seq_lens.data_ptr()
        decode_layers(self.layers, len(self.layers), ctypes.byref(step), x.data_ptr(), residual.data_ptr())
        return x, residual

    def _bind_caches(self, kv_caches: list[tuple[Tensor, Tensor]]) -> None:
        if self._caches is kv_caches:
            return
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("the fused decode path needs contiguous KV caches")
            layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._caches = kv_caches
