"""A linear layer that stacks several checkpoint projections into one matmul.

``q_proj``/``k_proj``/``v_proj`` become one ``qkv_proj`` and
``gate_proj``/``up_proj`` one ``gate_up_proj``: fewer, larger matmuls per
layer. The checkpoint keeps its separate tensors; each is copied into its
row range of the merged weight (and bias) by ``load_shard``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MergedLinear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
    ) -> None:
        if not shard_sizes or any(size <= 0 for size in shard_sizes.values()):
            raise ValueError(f"shard_sizes must be non-empty and positive, got {shard_sizes}")
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        # shard name -> (first output row, number of rows), in stacking order.
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shards[name] = (start, size)
            start += size

    def load_shard(self, shard: str, param_name: str, tensor: Tensor) -> None:
        """Copies one checkpoint tensor (``param_name`` is "weight" or "bias")
        into its rows of the merged parameter."""
        start, size = self.shards[shard]
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"{shard} has no {param_name} in this model")
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{shard}.{param_name} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(tensor)
