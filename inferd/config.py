"""Engine configuration: one dataclass, validated on construction.

Configuration flows one way: CLI flags or ``LLM(**kwargs)`` -> ``EngineConfig``
-> constructors. Nothing here reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from inferd.layers import quant
from inferd.layers.quant import INT4_GROUP_SIZES, QUANTIZATION_METHODS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GiB = 1 << 30


@dataclass
class EngineConfig:
    # A GGUF file or a Hugging Face directory; None means the embedded default model.
    model: str | None = None
    # "auto", "float32", "bfloat16" or "float16" (weights, activations and KV cache).
    dtype: str = "auto"
    # "auto", "cpu" or "cuda[:N]".
    device: str = "auto"
    # Weight-only quantization of the linear layers: "none", "int8" (per output
    # channel) or "int4" (asymmetric, per group of inputs); CPU only. With
    # dtype "auto" a quantized model runs in bfloat16 (see resolve_dtype).
    quantization: str = "none"
    # int4 group size: 32, 64 or 128 (a layer whose inputs it does not divide
    # takes the largest smaller one that does; GGUF Q4 tensors keep their 32).
    quantization_group_size: int = 32
    # Context length; None takes the model's own.
    max_model_len: int | None = None
    block_size: int = 16
    # Memory for the KV cache; None picks min(4 GiB, 20% of physical memory).
    kv_cache_memory_gb: float | None = None
    # Overrides the memory budget with an exact block count (tests, tuning).
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    # Share the K/V of identical prompt prefixes between requests.
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 1024
    seed: int = 0
    # Intra-op threads for torch on CPU; None keeps torch's default (one per core).
    num_threads: int | None = None
    # Speculative decoding: None (off), "ngram" (prompt lookup) or
    # "draft:MODEL" (a small model of the same tokenizer proposes).
    speculative: str | None = None
    # Draft tokens proposed per step for each decoding request.
    num_speculative_tokens: int = 4
    # Propose only while at most this many requests run: a bigger batch
    # already keeps the hardware busy, and drafts then cost more than they save.
    speculative_max_batch: int = 4

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}") from None
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}")
        group = self.quantization_group_size
        if isinstance(group, bool) or not isinstance(group, int) or group not in INT4_GROUP_SIZES:
            sizes = ", ".join(map(str, INT4_GROUP_SIZES))
            raise ValueError(f"quantization_group_size must be one of {sizes}; got {group!r}")
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if self.speculative is not None:
            self.speculative_method()  # validates
            _positive_int("num_speculative_tokens", self.num_speculative_tokens)
            _positive_int("speculative_max_batch", self.speculative_max_batch)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def speculative_method(self) -> tuple[str, str | None]:
        """("ngram", None) or ("draft", model path); raises ValueError naming the field."""
        spec = self.speculative
        if spec == "ngram":
            return "ngram", None
        if isinstance(spec, str) and spec.startswith("draft:") and len(spec) > len("draft:"):
            return "draft", spec[len("draft:") :]
        raise ValueError(f"speculative must be 'ngram' or 'draft:MODEL', got {spec!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if self.quantization != "none":
            # bfloat16 where the CPU multiplies bf16 in hardware (AVX512-BF16,
            # AMX): the quantized layers' matmul path computes in bf16 there
            # and the KV cache halves. Elsewhere float32, whose GEMM and SDPA
            # PyTorch runs several times faster than bf16: on a 2-core AVX2
            # CPU the fused batch-1 decode is about even (121.7 vs 119.1
            # tok/s) but the per-op path gains 51.5 vs 36.1
            # (benchmarks/results/fused_decode.json), and prefill-heavy
            # serving more (int4 at 32 streams: 126 tok/s in float32, 85 in
            # bfloat16 in an earlier run, benchmarks/results/concurrency32.json).
            return quant.matmul_dtype()
        # On CPU float32 GEMV reads weights at full memory bandwidth while
        # oneDNN's bf16 path does not yet (see benchmarks/), so float32 wins.
        return torch.float32

    def kv_cache_bytes(self) -> int:
        if self.kv_cache_memory_gb is not None:
            return int(self.kv_cache_memory_gb * _GiB)
        return min(4 * _GiB, _physical_memory() // 5)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * _GiB
