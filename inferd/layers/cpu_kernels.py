"""Small C kernels for CPUs, compiled on the machine that runs them.

PyTorch has no paged-attention kernel for CPUs, and gathering the cached
K/V into a copy for SDPA costs more than the attention itself. The kernels
live as plain C in ``kernels/`` and are compiled on first use with the
system C compiler (``cc -O3 -march=native -fopenmp``, about a second), then
loaded with ``ctypes``: no PyTorch headers, no build step at install time.
The shared object is cached under ``$XDG_CACHE_HOME/inferd/kernels`` (or
``~/.cache/inferd/kernels``), named by a hash of the source, the flags and
the CPU's feature flags, so a second start only loads it.

Where no compiler is found or the build fails, ``paged_attention_kernel()``
returns None once (with one warning in the log) and callers keep their
PyTorch path.
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

_SOURCE = Path(__file__).parent / "kernels" / "paged_attention.c"
# -ffast-math lets the compiler reassociate the dot products and call
# glibc's vector expf: the kernel's loops vectorize (it avoids infinities).
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-shared")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(source: Path) -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(
        source.read_bytes() + " ".join(_FLAGS).encode() + compiler.encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place, so concurrent starts
    # never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(source), "-lm"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build(_SOURCE)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU paged-attention kernel unavailable, using the PyTorch path: %s", e)
        return None
    fn = lib.paged_attention_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def paged_attention_kernel() -> bool:
    """True when the compiled kernel is loaded (building it on first call)."""
    return _library() is not None


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Attention of one query token per sequence over its cached K/V.

    ``q`` (S, H, D); ``k_cache``/``v_cache`` (num_blocks, block_size, KVH, D);
    ``tables`` (S, max_blocks) int64; ``seq_lens`` (S,) int64, each the
    number of cached tokens to attend (the query's own included). Returns
    (S, H, D) in ``q``'s dtype. Raises ValueError for arguments it cannot take.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    if q.dtype not in _DTYPE_CODES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
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
        float(scale), _DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"paged_decode_attention: {_ERRORS.get(code, f'error {code}')}")
    return out
