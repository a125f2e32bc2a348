"""Linear kernels by input rows: where inferd's C kernels stop paying.

For each linear shape of the default model (qkv, o, gate_up, down, LM head)
and a range of input rows M, times one call of:
  * fp32 / bf16: F.linear on a float32 / bfloat16 weight (PyTorch's GEMM);
  * fp32_kernel / bf16_kernel: inferd's few-row kernel on the same weights;
  * int8_kernel / int4_kernel: Int8Linear / Int4Linear's C kernel (group 32),
    bf16 activations in and out;
  * int8_dequant / int4_dequant: their dequantize + matmul path (bf16 where
    the CPU has bf16 hardware, else float32: ``quant.matmul_dtype``);
  * int8_torch / int4_torch: PyTorch's packed low-bit kernels
    (``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``),
    bf16 activations, on the same codes: the baseline the C kernels replace.
Each figure is the fastest of repeated calls, and of several passes over the
whole grid (min, not median: the machine's 2 cores are shared, and a
neighbour's job only ever adds time). A crossover is the largest M at which
the kernel is still faster (than dequantize + matmul for int8/int4, than
PyTorch's GEMM for fp32/bf16) on every shape except the LM head, which is
reported on its own.

Then, end to end on the default model, each (quantization, dtype) pair in its
own child process, best of two passes: batch-1 decode tok/s (128 tokens), 32-stream decode tok/s
(32 tokens each) and the time to prefill one 1000-token prompt. dtype is the
model's activation / KV-cache dtype.

    python benchmarks/quant_kernels.py [--threads N] [--quick] [--skip-e2e]

Writes benchmarks/results/quant_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from inferd.layers.cpu_kernels import linear_small
from inferd.layers.int4_layout import unpack_int4
from inferd.layers.quant import Int4Linear, Int8Linear, matmul_dtype

RESULTS = Path(__file__).parent / "results" / "quant_kernels.json"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 512]
KINDS = ("fp32", "bf16", "int8", "int4")


def best_us(fn: Callable[[], object], budget_s: float) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 300):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def build_layers(n: int, k: int) -> dict[str, object]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    l4 = Int4Linear.from_float(w, 32)
    codes = unpack_int4(l4.packed).to(torch.int32)
    return {
        "w": w, "wb": w.to(torch.bfloat16), "int8": Int8Linear.from_float(w), "int4": l4,
        # PyTorch's own int4 layout of the same codes, (K / 32, N, 2) scale/zero pairs.
        "int4_torch": (torch._convert_weight_to_int4pack_for_cpu(codes, 1), l4.scales_zeros.transpose(0, 1).contiguous()),
    }  # fmt: skip


def time_shape(layers: dict[str, object], rows: list[int], budget_s: float) -> dict[str, dict[int, float]]:
    w, wb, l8, l4 = layers["w"], layers["wb"], layers["int8"], layers["int4"]
    packed_torch, pairs_torch = layers["int4_torch"]
    k = w.shape[1]
    results: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            xm = x.to(matmul_dtype())  # what the layers' matmul path computes in on this CPU
            fns = {
                "fp32": lambda: F.linear(x, w),
                "bf16": lambda: F.linear(xb, wb),
                "int8_dequant": lambda: l8._dequantized_matmul(xm),
                "int8_torch": lambda: torch._weight_int8pack_mm(xb, l8.codes, l8.scales),
                "int4_dequant": lambda: l4._dequantized_matmul(xm),
                "int4_torch": lambda: torch._weight_int4pack_mm_for_cpu(xb, packed_torch, 32, pairs_torch),
            }
            if m <= 64:  # the C kernel's limit (cpu_kernels.LINEAR_MAX_ROWS)
                fns |= {
                    "fp32_kernel": lambda: linear_small(x, w),
                    "bf16_kernel": lambda: linear_small(xb, wb),
                    "int8_kernel": lambda: linear_small(xb, l8.codes, l8.scales),
                    "int4_kernel": lambda: linear_small(xb, l4.packed, l4.scales_zeros, 32),
                }
            for name, fn in fns.items():
                results.setdefault(name, {})[m] = round(best_us(fn, budget_s), 1)
    return results


def best_of(tables: list[dict[str, dict[int, float]]]) -> dict[str, dict[int, float]]:
    """Cell by cell, the fastest of several passes: a pass that a neighbour's
    job slowed down loses to one that ran alone."""
    return {kind: {m: min(t[kind][m] for t in tables) for m in tables[0][kind]} for kind in tables[0]}


def crossover(table: dict[str, dict[int, float]], kind: str) -> int:
    """The largest M below which the C kernel never loses to the other path
    (dequantize + matmul for int8/int4, PyTorch's GEMM for fp32/bf16)."""
    other = table[f"{kind}_dequant"] if f"{kind}_dequant" in table else table[kind]
    best = 0
    for m in sorted(table[f"{kind}_kernel"]):
        if table[f"{kind}_kernel"][m] > other[m]:
            break
        best = m
    return best


def run_e2e(quantization: str, dtype: str, quick: bool, queue) -> None:  # noqa: ANN001
    from inferd import LLM, SamplingParams

    llm = LLM(quantization=quantization, dtype=dtype, kv_cache_memory_gb=1.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(64)] for _ in range(32)]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    def decode_tok_s(batch: int, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        first = min(o.metrics.first_token_time for o in outs)
        finish = max(o.metrics.finish_time for o in outs)
        return batch * (tokens - 1) / (finish - first)

    batch1 = max(decode_tok_s(1, 32 if quick else 128) for _ in range(2))
    batch32 = decode_tok_s(32, 8 if quick else 32)
    long = [[rng.randrange(100, 49152) for _ in range(1000)]]
    start = time.perf_counter()
    llm.generate(long, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    prefill_ms = (time.perf_counter() - start) * 1000
    queue.put({"batch1_tok_s": round(batch1, 1), "batch32_tok_s": round(batch32, 1), "prefill_1000_ms": round(prefill_ms)})


def in_child(*args: object) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_e2e, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def end_to_end(quick: bool, passes: int) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {}
    for _ in range(passes):
        for quantization in ("none", "int8", "int4"):
            for dtype in ("float32", "bfloat16"):
                runs.setdefault(f"{quantization}/{dtype}", []).append(in_child(quantization, dtype, quick))
    results = {}
    for key, rs in runs.items():
        r = results[key] = {
            "batch1_tok_s": max(x["batch1_tok_s"] for x in rs),
            "batch32_tok_s": max(x["batch32_tok_s"] for x in rs),
            "prefill_1000_ms": min(x["prefill_1000_ms"] for x in rs),
        }
        print(f"{key:14s} batch-1 {r['batch1_tok_s']:6.1f} tok/s, 32 streams "
              f"{r['batch32_tok_s']:6.1f} tok/s, prefill 1000 tokens {r['prefill_1000_ms']} ms", flush=True)  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="fewer rows and repeats, to check the script runs")
    ap.add_argument("--passes", type=int, default=3, help="passes over the kernel grid; each cell keeps its fastest")
    ap.add_argument("--skip-e2e", action="store_true", help="kernels only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows, budget = ([1, 16, 64], 0.05) if a.quick else (ROWS, 0.15)
    layers = {name: build_layers(n, k) for name, (n, k) in SHAPES.items()}
    passes: dict[str, list[dict[str, dict[int, float]]]] = {name: [] for name in SHAPES}
    for i in range(1 if a.quick else a.passes):
        for name in SHAPES:
            passes[name].append(time_shape(layers[name], rows, budget))
        print(f"pass {i + 1} done", flush=True)
    shapes = {}
    for name, (n, k) in SHAPES.items():
        table = best_of(passes[name])
        shapes[name] = {"out_features": n, "in_features": k, "us": table}
        for kind in KINDS:
            shapes[name][f"{kind}_crossover_rows"] = crossover(table, kind)
        print(f"{name} {n}x{k}: the kernel wins up to M = "
              + ", ".join(f"{kind} {shapes[name][f'{kind}_crossover_rows']}" for kind in KINDS), flush=True)
        for m in rows:
            print("  M=%-4d " % m + " ".join(f"{kind}={table[kind][m]:.0f}" for kind in table if m in table[kind]))
    body = [s for name, s in shapes.items() if name != "lm_head"]
    crossovers = {f"{kind}_crossover_rows": min(s[f"{kind}_crossover_rows"] for s in body) for kind in KINDS}
    print("crossover (body layers): " + ", ".join(f"{k} M<={v}" for k, v in crossovers.items()))
    result = {
        "benchmark": "quant_kernels",
        "unit": "microseconds per call, best of repeats",
        "threads": torch.get_num_threads(),
        **crossovers,
        **{f"lm_head_{kind}_crossover_rows": shapes["lm_head"][f"{kind}_crossover_rows"] for kind in KINDS},
        "shapes": shapes,
        "end_to_end": None if a.skip_e2e else end_to_end(a.quick, 1 if a.quick else 2),
        "command": "python benchmarks/quant_kernels.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} nproc={__import__('os').cpu_count()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    if not a.quick:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
