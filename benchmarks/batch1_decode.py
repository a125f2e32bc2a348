"""Batch-1 decode speed per weight format, beside the memory-bandwidth limit.

One request on the default model, a 32-token prompt and 256 output tokens
(greedy, EOS ignored), for each variant: float32, bfloat16, int8 and int4
weights (``--quantization``). Each variant runs in its own child process
(its peak RSS is its own) ``--repeats`` times; the figure is the best
decode rate of the repeats (the median is recorded beside it: on these
shared cores a neighbour's job only ever takes speed away), output tokens
after the first over the time from the first token to the last.

The limit is the bytes one decode step must read (every weight a token
passes through: all linear layers and the output projection, not the
embedding table, of which one row is read; plus the K/V of the run's mean
context) over the memory bandwidth,
measured in this same invocation as the best of a float32 GEMV over 512 MiB
of weights (what a decode step does) and of a sum over 1 GiB.

    python benchmarks/batch1_decode.py [--variants fp32,bf16,int8,int4] [--out PATH]

Writes benchmarks/results/batch1_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _server import vm_hwm_mb  # the script's folder

RESULTS = Path(__file__).parent / "results" / "batch1_decode.json"
VARIANTS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def bytes_per_token(model) -> int:  # noqa: ANN001
    """Bytes of every tensor one decode step reads in full."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    # A float embedding table beside an LM head is only indexed; a quantized
    # tied embedding has no table of its own (it reads the head's int8 codes).
    embed = getattr(model.model.embed_tokens, "weight", None)
    if model.lm_head is not None and embed is not None:
        total -= embed.numel() * embed.element_size()
    return total


def child(variant: str, output_len: int, repeats: int) -> dict:
    import torch

    from inferd import LLM, SamplingParams
    from inferd.engine.runner import kv_cache_bytes_per_block

    llm = LLM(kv_cache_memory_gb=0.5, **VARIANTS[variant])
    engine = llm.engine
    prompt = llm.tokenizer.encode("The history of the city begins with a small market by the river, where")[:32]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(repeats):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        rates.append((len(out.outputs[0].token_ids) - 1) / (m.finish_time - m.first_token_time))
    peak = vm_hwm_mb(os.getpid())
    return {
        # Best of the repeats: the machine's 2 cores are shared, and a
        # neighbour's job only ever takes speed away.
        "tok_s": max(rates),
        "median_tok_s": statistics.median(rates),
        "runs_tok_s": rates,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weight_bytes_per_token": bytes_per_token(engine.runner.model),
        # K/V one step reads at the run's mean context length.
        "kv_bytes_per_token": kv_cache_bytes_per_block(engine.model_config, 1, engine.dtype)
        * (len(prompt) + output_len / 2),
        "threads": torch.get_num_threads(),
        "peak_rss_mb": peak,
    }


def bandwidth_gb_s() -> dict:
    import torch

    torch.manual_seed(0)
    w = torch.randn(32768, 4096)  # 512 MiB float32
    x = torch.randn(1, 4096)
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    gemv, total = [], []
    for _ in range(5):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        gemv.append(w.numel() * 4 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        big.sum()
        total.append(big.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return {"gemv_gb_s": max(gemv), "sum_gb_s": max(total)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.output_len, a.repeats)))
        return

    bw = bandwidth_gb_s()
    bandwidth = max(bw.values())
    result: dict = {
        "benchmark": "batch1_decode",
        "workload": f"default model, batch 1, 32-token prompt, {a.output_len} output tokens, greedy, EOS ignored",
        "bandwidth_gb_s": bandwidth,
        "bandwidth_measurements": bw,
    }
    variants = {}
    for name in a.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        cmd = [sys.executable, __file__, "--child", name, "--output-len", str(a.output_len), "--repeats", str(a.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["bandwidth_limit_tok_s"] = bandwidth * 1e9 / (r["weight_bytes_per_token"] + r["kv_bytes_per_token"])
        r["fraction_of_limit"] = r["tok_s"] / r["bandwidth_limit_tok_s"]
        variants[name] = r
        result[f"{name}_tok_s"] = r["tok_s"]
        result[f"{name}_bandwidth_limit_tok_s"] = r["bandwidth_limit_tok_s"]
        print(
            f"{name}: {r['tok_s']:.1f} tok/s, limit {r['bandwidth_limit_tok_s']:.1f} "
            f"({(r['weight_bytes_per_token'] + r['kv_bytes_per_token']) / 1e6:.0f} MB/token at {bandwidth:.1f} GB/s), peak RSS {r['peak_rss_mb']:.0f} MB"
        )
    if "fp32" in variants:
        for name, r in variants.items():
            result[f"{name}_vs_fp32"] = r["tok_s"] / variants["fp32"]["tok_s"]
    result["variants"] = variants
    result["command"] = "python benchmarks/batch1_decode.py " + " ".join(sys.argv[1:])
    result["machine"] = f"{platform.machine()} nproc={os.cpu_count()}"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
