"""Float linear layers: decode rows through inferd's CPU kernel, and one
layer that stacks several checkpoint projections into one matmul.

``Linear`` is ``nn.Linear`` whose few-row calls on the CPU (decode steps)
go through ``cpu_kernels.linear_small``, which reads each weight once at
memory speed: PyTorch's CPU GEMM runs a single row at a fraction of the
bandwidth on some CPUs (MKL on AMD), and bfloat16 ones slower still without
bf16 hardware (``benchmarks/results/quant_kernels.json``). Many rows keep
PyTorch's GEMM.

``MergedLinear``: ``q_proj``/``k_proj``/``v_proj`` become one ``qkv_proj``
and ``gate_proj``/``up_proj`` one ``gate_up_proj``: fewer, larger matmuls
per layer. The checkpoint keeps its separate tensors; each is copied into
its row range of the merged weight (and bias) by ``load_shard``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.layers.cpu_kernels import LINEAR_MAX_ROWS, kernels_available, linear_small
from inferd.layers.quant import matmul_dtype

# Input rows up to which the kernel beats PyTorch's GEMM on every decoder
# shape of the default model (benchmarks/results/quant_kernels.json, 2 cores,
# AVX2): 12 in float32; in bfloat16 up to the kernel's limit, since without
# bf16 hardware PyTorch's bf16 GEMM runs at a quarter of its float32 speed.
# Where the CPU has bf16 hardware (AVX512-BF16, AMX) the bf16 GEMM is
# oneDNN's fast path, and the float32 figure is used (not measured here).
FLOAT32_KERNEL_MAX_ROWS = 12


@functools.cache
def dense_kernel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which ``dense_linear`` takes the kernel for ``dtype`` weights."""
    if dtype == torch.bfloat16 and matmul_dtype() != torch.bfloat16:
        return LINEAR_MAX_ROWS
    return FLOAT32_KERNEL_MAX_ROWS if dtype in (torch.float32, torch.bfloat16) else 0


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with few-row CPU calls through the kernel when ``x`` and
    ``weight`` share a float32 or bfloat16 dtype."""
    if (
        x.dim() == 2
        and x.dtype is weight.dtype
        and x.shape[0] <= dense_kernel_max_rows(x.dtype)
        and x.device.type == "cpu"
        and not (weight.requires_grad and torch.is_grad_enabled())
        and kernels_available()
    ):
        out = linear_small(x, weight)
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return dense_linear(x, self.weight, self.bias)


class MergedLinear(Linear):
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
