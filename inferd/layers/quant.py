"""Weight-only int8 and int4 linear layers for CPU.

Weights are stored in 8 or 4 bits and activations stay floating point.
Decoding a few sequences is bound by reading the weights, so 1 or 0.5 bytes
per weight instead of 4 is the speed-up. Each layer picks one of two ways per
call, by the number of input rows:

- few rows: inferd's C kernel (``cpu_kernels.linear_small``), which reads
  each low-bit weight once, widens it in registers and multiplies it into
  every row, so its cost is reading the weight and grows slowly with rows;
  float32 sums, in and out in the activations' dtype;
- many rows (prefill chunks, large decode batches), or where the kernel
  could not be built: dequantize the weight into a shared scratch buffer
  and run one matmul, whose cost is nearly flat in rows. In bf16 where the
  CPU multiplies bf16 in hardware (AVX512-BF16, AMX), else in float32:
  without it PyTorch's bf16 GEMM ran 4x slower than its float32 one here.

The crossovers below were measured with ``benchmarks/quant_kernels.py``
(results/quant_kernels.json) on 2 cores, default model shapes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.layers.cpu_kernels import cpu_flags, dequantize_int4, kernels_available, linear_small
from inferd.layers.int4_layout import pack_int4, unpack_int4

# Scales and zeros are stored in bf16 (GGUF's are f16: bf16 keeps their range).
SCALE_DTYPE = torch.bfloat16
QUANTIZATION_METHODS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
# Rows up to which the C kernel beats dequantize + float32 matmul on every
# decoder shape of the default model (benchmarks/results/quant_kernels.json,
# 2 cores, AVX2); both at most cpu_kernels.LINEAR_MAX_ROWS.
INT8_KERNEL_MAX_ROWS = 24
INT4_KERNEL_MAX_ROWS = 48
# Weight elements dequantized at a time on the matmul path: the 49152-row LM
# head goes in slices so the scratch stays 8 MB.
_DEQUANT_CHUNK_ELEMENTS = 1 << 22


@functools.cache
def matmul_dtype() -> torch.dtype:
    """The dtype of the dequantize + matmul path on this CPU."""
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()) else torch.float32


def _kernel_applies(x: Tensor, max_rows: int) -> bool:
    return (
        x.shape[0] <= max_rows
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and kernels_available()
    )


class DequantScratch:
    """Buffers the quantized layers of one model share on the dequantize path.

    Steps run one at a time, so one buffer per dtype, sized to the largest
    chunk, serves every layer and the path never allocates a weight-sized
    tensor: memory stays one chunk whatever the batch. (Speed is the same
    either way here: 129 vs 131 us to widen 3072x576 int8 into it or into a
    fresh tensor.)
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = rows * cols
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(rows, cols)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: ``(out, in)`` float -> int8 codes in
    -127..127 and ``(out,)`` bf16 scales with ``weight ~ codes * scales``.

    The scale is rounded up to a bf16 value before the codes are chosen, so
    the stored scale is the one the codes were rounded against and nothing
    clips."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    stored = scale.to(SCALE_DTYPE)
    low = stored.float() < scale
    stored[low] = torch.nextafter(stored[low], torch.full_like(stored[low], float("inf")))
    codes = torch.round(w / stored.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, stored


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 per group of ``group_size`` inputs: ``(out, in)`` float ->
    codes in 0..15 (uint8) and ``(out, in / group_size)`` scales and zeros,
    bf16, with ``weight ~ (codes - 8) * scale + zero`` (the kernel's form).

    Codes are rounded against the bf16 scale and zero actually stored."""
    n, k = weight.shape
    _check_group(group_size, k)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).to(SCALE_DTYPE)
    zero = (lo + 8 * scale.float()).to(SCALE_DTYPE)
    codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scale, zero


def _check_group(group_size: int, in_features: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(
            f"quantization_group_size {group_size} does not divide in_features {in_features}"
        )


def _finish(out: Tensor, dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    out = out.to(dtype)
    return out if bias is None else out.add_(bias)


def _check_input(x: Tensor, in_features: int) -> None:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected input of shape (T, {in_features}), got {tuple(x.shape)}")


class Int8Linear(nn.Module):
    """``y = x @ (codes * scales[:, None]).T + bias``: int8 codes ``(out, in)``
    and one bf16 scale per output channel."""

    def __init__(
        self, codes: Tensor, scales: Tensor, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"int8 codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
        self.out_features, self.in_features = codes.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"scales must have shape ({self.out_features},), got {tuple(scales.shape)}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(SCALE_DTYPE).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.scratch = scratch if scratch is not None else DequantScratch()
        # Few rows through the C kernel; False forces the matmul path (tests).
        self.use_kernel = True

    @classmethod
    def from_float(
        cls, weight: Tensor, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> Int8Linear:
        codes, scales = quantize_int8(weight)
        return cls(codes, scales, bias, scratch)

    def forward(self, x: Tensor) -> Tensor:
        """(T, in) -> (T, out) in x's dtype."""
        _check_input(x, self.in_features)
        if self.use_kernel and _kernel_applies(x, INT8_KERNEL_MAX_ROWS):
            out = linear_small(x, self.codes, self.scales)
        else:
            out = self._dequantized_matmul(x.to(matmul_dtype()).contiguous())
        return _finish(out, x.dtype, self.bias)

    def _dequantized_matmul(self, x: Tensor) -> Tensor:
        # The per-channel scale factors out of the matmul: (x @ codes.T) * scales.
        step = max(1, _DEQUANT_CHUNK_ELEMENTS // self.in_features)
        parts = []
        for start in range(0, self.out_features, step):
            rows = self.codes[start : start + step]
            weight = self.scratch.take(rows.shape[0], self.in_features, x.dtype, x.device)
            parts.append(F.linear(x, weight.copy_(rows)))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.mul_(self.scales)

    def dequantize(self) -> Tensor:
        """The float32 ``(out, in)`` weight this layer multiplies by."""
        return self.codes.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """A token embedding that reads an ``Int8Linear``'s table: a tied LM head
    and embedding share the int8 codes, and looked-up rows are dequantized."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype
        self.register_buffer("codes", table.codes)
        self.register_buffer("scales", table.scales)

    def forward(self, input_ids: Tensor) -> Tensor:
        """(T,) token ids -> (T, hidden) in the model's dtype."""
        rows = self.codes.index_select(0, input_ids).float()
        return (rows * self.scales.index_select(0, input_ids).float()[:, None]).to(self.dtype)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias``, ``W[n, k] = (codes[n, k] - 8) * scale[n, g] +
    zero[n, g]`` with ``g = k // group_size``: 4-bit codes (packed two a
    byte, ``inferd.layers.int4_layout``) and one bf16 scale and zero per
    group of consecutive inputs (asymmetric)."""

    def __init__(
        self,
        codes: Tensor,
        scales: Tensor,
        zeros: Tensor,
        group_size: int,
        bias: Tensor | None = None,
        scratch: DequantScratch | None = None,
    ) -> None:
        super().__init__()
        if codes.dim() != 2:
            raise ValueError(f"int4 codes must be 2-D, got shape {tuple(codes.shape)}")
        self.out_features, self.in_features = codes.shape
        _check_group(group_size, self.in_features)
        groups = (self.out_features, self.in_features // group_size)
        if scales.shape != groups or zeros.shape != groups:
            raise ValueError(
                f"scales and zeros must have shape {groups}, got {tuple(scales.shape)} and {tuple(zeros.shape)}"
            )
        self.group_size = group_size
        self.register_buffer("packed", pack_int4(codes))  # (out, in / 2) uint8
        # (out, in / group, 2) bf16: each group's scale and zero side by side.
        pairs = torch.stack([scales.to(SCALE_DTYPE), zeros.to(SCALE_DTYPE)], dim=-1)
        self.register_buffer("scales_zeros", pairs.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.scratch = scratch if scratch is not None else DequantScratch()
        # Few rows through the C kernel; False forces the matmul path (tests).
        self.use_kernel = True

    @classmethod
    def from_float(
        cls, weight: Tensor, group_size: int, bias: Tensor | None = None, scratch: DequantScratch | None = None
    ) -> Int4Linear:
        codes, scales, zeros = quantize_int4(weight, group_size)
        return cls(codes, scales, zeros, group_size, bias, scratch)

    @classmethod
    def from_affine(
        cls,
        codes: Tensor,
        scales: Tensor,
        mins: Tensor,
        group_size: int,
        bias: Tensor | None = None,
        scratch: DequantScratch | None = None,
    ) -> Int4Linear:
        """From ``W = codes * scale + min`` per group (GGUF Q4_1; Q4_0 is
        ``min = -8 * scale``): the zero is ``min + 8 * scale``, in float32,
        then both are rounded to bf16."""
        zeros = mins.float() + 8 * scales.float()
        return cls(codes, scales.float(), zeros, group_size, bias, scratch)

    def forward(self, x: Tensor) -> Tensor:
        """(T, in) -> (T, out) in x's dtype."""
        _check_input(x, self.in_features)
        if self.use_kernel and _kernel_applies(x, INT4_KERNEL_MAX_ROWS):
            out = linear_small(x, self.packed, self.scales_zeros, self.group_size)
        else:
            out = self._dequantized_matmul(x.to(matmul_dtype()).contiguous())
        return _finish(out, x.dtype, self.bias)

    def _dequantized_matmul(self, x: Tensor) -> Tensor:
        step = max(1, _DEQUANT_CHUNK_ELEMENTS // self.in_features)
        parts = []
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            weight = self.scratch.take(stop - start, self.in_features, x.dtype, x.device)
            parts.append(F.linear(x, self._dequantize_rows(start, stop, weight)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _dequantize_rows(self, start: int, stop: int, out: Tensor) -> Tensor:
        if self.use_kernel and out.device.type == "cpu" and kernels_available():
            return dequantize_int4(self.packed, self.scales_zeros, self.group_size, start, stop, out)
        return out.copy_(self._float_rows(start, stop))

    def _float_rows(self, start: int, stop: int) -> Tensor:
        """Rows [start, stop) of W in float32: ``(code - 8) * scale + zero``."""
        rows = stop - start
        codes = unpack_int4(self.packed[start:stop]).float().view(rows, -1, self.group_size)
        pairs = self.scales_zeros[start:stop].float()  # (rows, in / g, 2)
        return ((codes - 8) * pairs[..., :1] + pairs[..., 1:]).view(rows, self.in_features)

    def dequantize(self) -> Tensor:
        """The float32 ``(out, in)`` weight this layer multiplies by."""
        return self._float_rows(0, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )
