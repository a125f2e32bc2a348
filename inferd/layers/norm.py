"""RMSNorm with Hugging Face's numerics: normalise in float32, cast back,
then scale by the weight in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Normalises ``x + residual`` (just ``x`` when residual is None).

        Returns ``(normed, new_residual)``. The sum is taken in the model dtype
        before normalising, as a decoder layer's residual stream does in
        transformers, so fusing the add here changes nothing numerically.
        """
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.to(x.dtype) * self.weight, x
