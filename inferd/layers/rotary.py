"""Rotary position embedding (RoPE) in Hugging Face's rotate-half layout.

A head vector ``x`` of size ``D`` is split into halves ``(x1, x2)`` and
rotated pairwise: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, with one
frequency per pair. The frequency variants (``rope_scaling["rope_type"]``)
differ only in how the inverse frequencies are computed, so each variant is a
function in ``_INV_FREQ_FUNCTIONS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def _default_inv_freq(head_dim: int, theta: float) -> Tensor:
    # float32 throughout, like transformers, so frequencies match bit for bit.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def _required(scaling: dict[str, Any], key: str) -> float:
    if key not in scaling:
        raise ValueError(f"rope_scaling of type {scaling['rope_type']!r} needs {key!r}")
    return float(scaling[key])


def _linear_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int) -> Tensor:
    # Dividing the frequencies equals dividing the positions by the factor.
    return _default_inv_freq(head_dim, theta) / _required(scaling, "factor")


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_pos: int) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, and
    interpolate smoothly in the band between."""
    inv_freq = _default_inv_freq(head_dim, theta)
    factor = _required(scaling, "factor")
    low_freq_factor = _required(scaling, "low_freq_factor")
    high_freq_factor = _required(scaling, "high_freq_factor")
    if high_freq_factor <= low_freq_factor:
        raise ValueError(
            "rope_scaling high_freq_factor must exceed low_freq_factor, "
            f"got {high_freq_factor} and {low_freq_factor}"
        )
    old_context = float(scaling.get("original_max_position_embeddings", max_pos))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


_InvFreqFn = Callable[[int, float, dict[str, Any], int], Tensor]
_INV_FREQ_FUNCTIONS: dict[str, _InvFreqFn] = {
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


def compute_inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
) -> Tensor:
    """The ``(head_dim // 2,)`` float32 inverse frequencies, on the CPU."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if rope_scaling is None:
        return _default_inv_freq(head_dim, theta)
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return _default_inv_freq(head_dim, theta)
    fn = _INV_FREQ_FUNCTIONS.get(kind)
    if fn is None:
        supported = ", ".join(sorted(_INV_FREQ_FUNCTIONS))
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {supported})")
    return fn(head_dim, theta, {**rope_scaling, "rope_type": kind}, max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """Computes the per-token rotation once per forward; layers apply it."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round
        # the frequencies, and checkpoints do not carry them.
        self.inv_freq = compute_inv_freq(head_dim, theta, rope_scaling, max_position_embeddings)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions`` (T,) -> ``cos``, ``sin`` each (T, 1, D) in ``dtype``.

        ``sin`` carries the rotate-half sign (negated first half) so applying
        the rotation is one multiply-add with the halves swapped.
        """
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq  # (T, D/2)
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates ``x`` (T, N, D) by ``cos``/``sin`` (T, 1, D) from RotaryEmbedding."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
