"""Small C kernels for CPUs, compiled on the machine that runs them.

- ``paged_attention.c``: PyTorch has no paged-attention kernel for CPUs, and
  gathering the cached K/V into a copy for SDPA costs more than the
  attention itself.
- ``linear.c``: linear layers for a few input rows (decoding) over float32,
  bfloat16, int8 and int4 weights, reading each weight once at memory
  speed, and the int4 weight's dequantization for the many-row path.
- ``decode_layer.c``: a decode step's decoder layers in one call, over the
  other two (``inferd.layers.fused_decode``).

The kernels live as plain C in ``kernels/`` and are compiled together on
first use with the system C compiler (``cc -O3 -march=native -fopenmp``,
about two seconds), then loaded with ``ctypes``: no PyTorch headers, no
build step at install time. The shared object is cached under
``$XDG_CACHE_HOME/inferd/kernels`` (or ``~/.cache/inferd/kernels``), named
by a hash of the sources, the flags and the CPU's feature flags, so a second
start only loads it.

Where no compiler is found or the build fails, ``kernels_available()``
returns False (with one warning in the log) and callers keep their PyTorch
path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_KERNELS = Path(__file__).parent / "kernels"
# -ffast-math lets the compiler reassociate the dot products and call
# glibc's vector expf: the kernel's loops vectorize (it avoids infinities).
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC")
# Linked apart from compiling: GCC before 13 links crtfastmath.o into any
# object built with -ffast-math, whose constructor turns on flush-to-zero
# for the whole process that loads it (numpy and hypothesis then see no
# subnormal floats). The link step gets no fast-math flag.
_LINK_FLAGS = ("-shared", "-fopenmp")
# The kernels' codes for activation dtypes and for weight kinds.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_WEIGHT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}  # uint8: packed int4
_ERRORS = {
    -1: "num_heads must be a multiple of num_kv_heads",
    -2: "group size, head_dim or block_size above the kernel's limits (16, 256, 128)",
    -3: "unsupported dtype",
    -4: "a sequence length is below 1 or beyond its block table",
    -5: "a block id is outside the cache",
}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferd" / "kernels"


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo (or the platform's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(name: str, sources: list[Path]) -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(
        b"".join(src.read_bytes() for src in (*sources, *_HEADERS))
        + " ".join((*_FLAGS, *_LINK_FLAGS)).encode() + compiler.encode() + cpu_flags().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so concurrent starts
    # never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
        steps = [[compiler, *_FLAGS, "-c", "-o", str(obj), str(src)] for src, obj in zip(sources, objects)]
        steps.append([compiler, *_LINK_FLAGS, "-o", str(built), *map(str, objects), "-lm"])
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True, timeout=120, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# One library from all the sources (decode_layer calls the other two).
_SOURCES = ("paged_attention.c", "linear.c", "decode_layer.c")
_HEADERS = (_KERNELS / "kernels.h",)
# function -> argument types (each returns an int status).
_SIGNATURES: dict[str, list[type]] = {
    "paged_attention_decode": [_P] * 6 + [_I] * 6 + [_I64, _F, _I, _I],
    "linear_small": [_P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I, _I],
    "dequantize_int4": [_P, _P, _I, _I, _I, _I, _P, _I, _I],
    "decode_layers": [_P, _I, _P, _P, _P],
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build("kernels", [_KERNELS / name for name in _SOURCES])))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s", e)
        return None
    for fn_name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, fn_name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def kernels_available() -> bool:
    """True when the compiled kernels are loaded (building them on first call)."""
    return _library() is not None


def _loaded() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    return lib


def weight_kind(weight: Tensor) -> int:
    """The kernels' code for a weight: float32 0, bfloat16 1, int8 codes 2,
    packed int4 codes (uint8, ``inferd.layers.int4_layout``) 3."""
    kind = _WEIGHT_KINDS.get(weight.dtype)
    if kind is None:
        raise ValueError(f"no CPU kernel takes {weight.dtype} weights")
    return kind


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Attention of one query token per sequence over its cached K/V.

    ``q`` (S, H, D); ``k_cache``/``v_cache`` (num_blocks, block_size, KVH, D);
    ``tables`` (S, max_blocks) int64; ``seq_lens`` (S,) int64, each the
    number of cached tokens to attend (the query's own included). Returns
    (S, H, D) in ``q``'s dtype. Raises ValueError for arguments it cannot take.
    """
    lib = _loaded()
    if q.dtype not in DTYPE_CODES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the caches must share a dtype in float32/bfloat16, got {q.dtype}, {k_cache.dtype}")
    if any(t.device.type != "cpu" for t in (q, k_cache, v_cache, tables, seq_lens)):
        raise ValueError("paged_decode_attention runs on CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}")
    if tables.dim() != 2 or tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"tables must be ({num_seqs}, max_blocks) and seq_lens ({num_seqs},)")
    q = q.contiguous()
    tables = tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    code = lib.paged_attention_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.shape[1], num_blocks,
        float(scale), DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"paged_decode_attention: {_ERRORS.get(code, f'error {code}')}")
    return out


# linear_small takes at most this many input rows (the C kernel's MAX_ROWS).
LINEAR_MAX_ROWS = 64
_LINEAR_ERRORS = {
    -1: f"input rows outside 1..{LINEAR_MAX_ROWS}",
    -2: "unsupported dtype or weight kind",
    -3: "int4 needs in_features a multiple of 32 up to 65536 and group_size 32 x a power of two dividing it",
    -4: "out of memory",
}


def _check_linear(code: int, fn: str) -> None:
    if code != 0:
        raise ValueError(f"{fn}: {_LINEAR_ERRORS.get(code, f'error {code}')}")


def linear_small(x: Tensor, weight: Tensor, scales: Tensor | None = None, group_size: int = 0) -> Tensor:
    """``x @ W.T`` for a few rows, reading ``weight`` once.

    ``x`` (M, K) float32 or bfloat16 on the CPU, 1 <= M <= LINEAR_MAX_ROWS.
    ``weight`` is one of: (N, K) float32 or bfloat16; (N, K) int8 codes with
    ``scales`` (N,) bf16; (N, K / 2) uint8 int4 codes
    (``inferd.layers.int4_layout``) with ``scales`` (N, K / group_size, 2) bf16
    scale/zero pairs. Returns (M, N) in ``x``'s dtype. Called once per layer
    per step, so it checks only what the layers do not: the input. The
    layer keeps its weight contiguous on the CPU.
    """
    lib = _loaded()
    dtype = DTYPE_CODES.get(x.dtype)
    if dtype is None or x.dim() != 2 or x.shape[1] != (weight.shape[1] * 2 if weight.dtype == torch.uint8 else weight.shape[1]):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} does not fit weight {weight.dtype} {tuple(weight.shape)}")
    x = x.contiguous()
    rows, k = x.shape
    kind = weight_kind(weight)
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    code = lib.linear_small(
        x.data_ptr(), dtype, rows, k, weight.data_ptr(), kind, weight.shape[0],
        None if scales is None else scales.data_ptr(), group_size,
        out.data_ptr(), dtype, torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        _check_linear(code, "linear_small")
    return out


def dequantize_int4(packed: Tensor, scales_zeros: Tensor, group_size: int, start: int, stop: int, out: Tensor) -> Tensor:
    """Writes rows ``[start, stop)`` of an int4 weight, ``(code - 8) * scale +
    zero`` in float32 rounded once, into ``out`` ((stop - start, K) float32 or
    bfloat16, contiguous) and returns it."""
    lib = _loaded()
    k = packed.shape[1] * 2
    if out.dtype not in DTYPE_CODES or out.shape != (stop - start, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({stop - start}, {k}) float32/bfloat16 tensor")
    if not 0 <= start <= stop <= packed.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) outside 0..{packed.shape[0]}")
    code = lib.dequantize_int4(
        packed.data_ptr(), scales_zeros.data_ptr(), k, group_size, start, stop,
        out.data_ptr(), DTYPE_CODES[out.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check_linear(code, "dequantize_int4")
    return out


def decode_layers(layers: object, num_layers: int, step: object, x_ptr: int, residual_ptr: int) -> None:
    """A decode step's decoder layers (``kernels/decode_layer.c``): the
    structures and pointers come from ``inferd.layers.fused_decode``, which
    owns their layouts."""
    code = _loaded().decode_layers(layers, num_layers, step, x_ptr, residual_ptr)
    if code == 0:
        return
    if code <= -20:
        raise ValueError(f"decode_layers: attention: {_ERRORS.get(code + 20, f'error {code + 20}')}")
    if code == -10:
        raise ValueError("decode_layers: head_dim must be even and at most 1024")
    if code == -11:
        raise MemoryError("decode_layers: out of memory")
    if code == -12:
        raise ValueError("decode_layers: a layer's linear shapes do not fit the model's")
    _check_linear(code, "decode_layers")
