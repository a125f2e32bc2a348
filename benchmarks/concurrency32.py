"""32 concurrent streams: `inferd serve` driven by `inferd bench` against
transformers' static-batch generate(), same machine, same invocation.

inferd: ``inferd serve`` on the default model with each ``--variant``'s flags,
then ``inferd bench --concurrency 32 --input-len 256 --output-len 128``
(random prompts, EOS ignored) over ``--num-prompts`` requests: output tokens
per second as the client sees them, prefill of every request included.

Baseline: transformers loads the same GGUF and runs ``generate()`` on static
batches of 32 prompts of 256 random token ids x 128 new tokens (greedy, no
EOS), in float32 and in bfloat16; the faster one is the baseline. Each side
runs in its own process; peak RSS is each process's own.

    python benchmarks/concurrency32.py [--num-prompts 96] [--variant NAME=FLAGS ...]

Writes benchmarks/results/concurrency32.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _server import free_port, log_tail, stop_server, vm_hwm_mb, wait_healthy  # the script's folder

RESULTS = Path(__file__).parent / "results" / "concurrency32.json"
DEFAULT_VARIANTS = ["fp32=--dtype float32", "bf16=--dtype bfloat16", "int8=--quantization int8", "int4=--quantization int4"]
CONCURRENCY, INPUT_LEN, OUTPUT_LEN = 32, 256, 128


def transformers_child(dtype_name: str, batches: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from inferd.models.default import default_model_path

    path = default_model_path()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def batch() -> torch.Tensor:
        return torch.tensor([[rng.randrange(100, vocab) for _ in range(INPUT_LEN)] for _ in range(CONCURRENCY)])

    with torch.inference_mode():
        ids = batch()
        model.generate(ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]), max_new_tokens=4, do_sample=False, pad_token_id=2)
        start = time.perf_counter()
        tokens = 0
        for _ in range(batches):
            ids = batch()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=2)
            tokens += (out.shape[1] - INPUT_LEN) * CONCURRENCY
        elapsed = time.perf_counter() - start
    peak = vm_hwm_mb(os.getpid())
    return {"dtype": dtype_name, "tok_s": tokens / elapsed, "output_tokens": tokens, "elapsed_s": elapsed, "peak_rss_mb": peak}


def run_transformers(dtype_name: str, batches: int) -> dict:
    cmd = [sys.executable, __file__, "--transformers-child", dtype_name, "--batches", str(batches)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"transformers ({dtype_name}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_inferd(flags: str, num_prompts: int) -> dict:
    from rich.console import Console

    from inferd.bench.main import run
    from inferd.cli import parse_config

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferd", "serve", "--host", "127.0.0.1", "--port", str(port), *shlex.split(flags)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_healthy(url, proc, 180)
                args = [
                    "bench", url, "--concurrency", str(CONCURRENCY), "--input-len", str(INPUT_LEN),
                    "--output-len", str(OUTPUT_LEN), "--num-prompts", str(num_prompts), "--seed", "0",
                    "--timeout", "300", "--output", str(out),
                ]  # fmt: skip
                rc = run(parse_config(args), Console(file=io.StringIO()))
                peak = vm_hwm_mb(proc.pid)
            except Exception as e:
                raise SystemExit(f"inferd serve {flags} failed: {e}\n{log_tail(log_path)}") from e
            finally:
                stop_server(proc, 60)
        if rc != 0:
            raise SystemExit(f"inferd bench failed against inferd serve {flags}")
        r = json.loads(out.read_text())
    return {
        "flags": flags,
        "output_throughput": r["output_throughput"],
        "total_token_throughput": r["total_token_throughput"],
        "median_ttft_ms": r["median_ttft_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "completed": r["completed"],
        "failed": r["failed"],
        "duration_s": r["duration"],
        "peak_rss_mb": peak,
        "bench_command": "inferd " + " ".join(args).replace(url, "URL").replace(str(out), "OUT.json"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--batches", type=int, default=2, help="transformers: static batches of 32")
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS", help="inferd serve flags to measure (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--transformers-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.transformers_child:
        print(json.dumps(transformers_child(a.transformers_child, a.batches)))
        return

    variants = dict(v.split("=", 1) for v in (a.variant or DEFAULT_VARIANTS))
    baselines = [run_transformers(d, a.batches) for d in ("float32", "bfloat16")]
    for b in baselines:
        print(f"transformers {b['dtype']}: {b['tok_s']:.1f} tok/s, peak RSS {b['peak_rss_mb']:.0f} MB")
    baseline = max(baselines, key=lambda b: b["tok_s"])
    runs = {}
    for name, flags in variants.items():
        runs[name] = r = run_inferd(flags, a.num_prompts)
        r["ratio_vs_transformers"] = r["output_throughput"] / baseline["tok_s"]
        print(
            f"inferd {name} ({flags}): {r['output_throughput']:.1f} output tok/s "
            f"({r['ratio_vs_transformers']:.2f}x), TTFT p50 {r['median_ttft_ms']:.0f} ms, "
            f"TPOT p50 {r['median_tpot_ms']:.0f} ms, failed {r['failed']}, peak RSS {r['peak_rss_mb']:.0f} MB"
        )
    best_name = max(runs, key=lambda n: runs[n]["output_throughput"])
    best = runs[best_name]
    result = {
        "benchmark": "concurrency32",
        "workload": f"{CONCURRENCY} concurrent streams, input {INPUT_LEN}, output {OUTPUT_LEN} (EOS ignored), "
        f"{a.num_prompts} requests through inferd bench; transformers: {a.batches} static batches of {CONCURRENCY}",
        "output_throughput": best["output_throughput"],
        "best_variant": best_name,
        "transformers_tok_s": baseline["tok_s"],
        "transformers_dtype": baseline["dtype"],
        "ratio_vs_transformers": best["ratio_vs_transformers"],
        "variants": runs,
        "transformers": baselines,
        "command": "python benchmarks/concurrency32.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} nproc={os.cpu_count()}",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
