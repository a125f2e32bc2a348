"""Offline throughput: inferd's engine against transformers' generate().

64 prompts of mixed length (16-512 tokens) x 128 output tokens (EOS ignored)
on the default model, with the same token ids and dtype for both:
  * inferd: all 64 handed to LLM.generate (continuous batching, paged KV);
  * transformers: generate() over left-padded static batches of 16.
Each side runs in its own child process, one after the other, so the peak RSS
of each is its own. Then batch-1 decode speed for one 256-token request,
beside this machine's memory bandwidth (measured here) divided by the
model's weight bytes: the most a memory-bound decode could reach.

    python benchmarks/offline_throughput.py [--dtype float32|bfloat16] [--quick]

Writes benchmarks/results/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import random
import resource
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "offline_throughput.json"


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the special tokens at the start of the vocabulary.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_inferd(prompts, max_tokens, dtype, queue) -> None:
    from inferd import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    one = llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True), use_tqdm=False)[0]
    m = one.metrics
    decode_tok_s = (len(one.outputs[0].token_ids) - 1) / (m.finish_time - m.first_token_time)
    queue.put(
        {
            "tok_s": tokens / elapsed,
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "batch1_decode_tok_s": decode_tok_s,
            "peak_rss_mb": peak_rss_mb(),
            "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:4]],
        }
    )


def run_transformers(prompts, max_tokens, dtype, batch_size, queue) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from inferd.models.default import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    # No EOS: every sequence runs to max_new_tokens, as with inferd's ignore_eos.
    model.generation_config.eos_token_id = None
    pad = 2

    def batch_generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return (out.shape[1] - width) * len(batch)

    batch_generate([prompts[0][:8]] * 2)  # warm-up
    start = time.perf_counter()
    tokens = sum(batch_generate(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
    elapsed = time.perf_counter() - start
    queue.put({"tok_s": tokens / elapsed, "elapsed_s": elapsed, "output_tokens": tokens, "peak_rss_mb": peak_rss_mb()})


def in_child(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def memory_bandwidth_gb_s(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: the best of a few full passes summing a large buffer."""
    import torch

    x = torch.ones(size_mb * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(dtype: str) -> int:
    import torch

    from inferd.models.loader import load_checkpoint
    from inferd.models.default import default_model_path

    ckpt = load_checkpoint(default_model_path())
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    # A decode step reads every weight once; the tied embedding is read as the
    # LM head (the embedding lookup itself touches only a few rows).
    return sum(t.numel() for _, t in ckpt.weights()) * size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, to check the script runs")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.quick:
        a.num_prompts, a.max_tokens = 8, 16

    prompts = make_prompts(a.num_prompts, 16, 512, vocab=49152)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {a.max_tokens} output tokens each, {a.dtype}")
    inferd = in_child(run_inferd, prompts, a.max_tokens, a.dtype)
    print(f"inferd:       {inferd['tok_s']:8.1f} tok/s  ({inferd['elapsed_s']:.1f}s, peak RSS {inferd['peak_rss_mb']:.0f} MB)")
    hf = in_child(run_transformers, prompts, a.max_tokens, a.dtype, a.batch_size)
    print(f"transformers: {hf['tok_s']:8.1f} tok/s  ({hf['elapsed_s']:.1f}s, peak RSS {hf['peak_rss_mb']:.0f} MB)")
    ratio = inferd["tok_s"] / hf["tok_s"]
    print(f"ratio:        {ratio:8.2f}x")

    bw = memory_bandwidth_gb_s()
    wbytes = weight_bytes(a.dtype)
    limit = bw * 1e9 / wbytes
    print(
        f"batch-1 decode: {inferd['batch1_decode_tok_s']:.1f} tok/s; memory bandwidth {bw:.1f} GB/s "
        f"/ {wbytes / 1e6:.0f} MB of weights = {limit:.1f} tok/s limit"
    )
    result = {
        "benchmark": "offline_throughput",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "dtype": a.dtype,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_tokens": a.max_tokens,
        "transformers_batch_size": a.batch_size,
        "inferd_tok_s": round(inferd["tok_s"], 2),
        "transformers_tok_s": round(hf["tok_s"], 2),
        "ratio": round(ratio, 3),
        "inferd_peak_rss_mb": round(inferd["peak_rss_mb"], 1),
        "transformers_peak_rss_mb": round(hf["peak_rss_mb"], 1),
        "inferd_elapsed_s": round(inferd["elapsed_s"], 2),
        "transformers_elapsed_s": round(hf["elapsed_s"], 2),
        "batch1_decode_tok_s": round(inferd["batch1_decode_tok_s"], 2),
        "memory_bandwidth_gb_s": round(bw, 2),
        "weight_bytes": wbytes,
        "batch1_bandwidth_limit_tok_s": round(limit, 2),
        "batch1_fraction_of_limit": round(inferd["batch1_decode_tok_s"] / limit, 3),
        "machine": f"{platform.machine()} {platform.processor() or ''} nproc={__import__('os').cpu_count()}".strip(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if not a.quick:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
