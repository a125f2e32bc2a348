"""Prefix caching: TTFT with the cache on against off, same workload.

8 system prompts of 1,000 tokens x 16 questions of 32 tokens each (128
requests, shuffled), 8 output tokens each, 4 in flight, sent by
``inferd bench --dataset shared-prefix`` to ``inferd serve`` on the default
model: once with ``--no-prefix-caching`` (the baseline), once with the cache
on (the default), one server after the other in this invocation. The hit
rate is the server's own ``inferd:prefix_cache_hits_total /
inferd:prefix_cache_queries_total`` over the run; peak RSS is each server's
VmHWM.

    python benchmarks/prefix_cache.py [--num-prompts 128] [--out PATH]

Writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from _server import free_port, stop_server, vm_hwm_mb, wait_healthy  # the script's folder
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).parent / "results" / "prefix_cache.json"
HEALTH_TIMEOUT_S = 180


def prefix_counters(url: str) -> tuple[float, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values.get("inferd:prefix_cache_hits_total", 0.0), values.get("inferd:prefix_cache_queries_total", 0.0)


def run_side(caching: bool, a: argparse.Namespace) -> dict:
    from rich.console import Console

    from inferd.bench.main import run
    from inferd.cli import parse_config

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferd", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if not caching:
        cmd.append("--no-prefix-caching")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        with open(Path(tmp) / "serve.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_healthy(url, proc, HEALTH_TIMEOUT_S)
                hits0, queries0 = prefix_counters(url)
                args = [
                    "bench", url, "--dataset", "shared-prefix", "--num-prefixes", "8", "--prefix-len", "1000",
                    "--input-len", "32", "--output-len", "8", "--num-prompts", str(a.num_prompts),
                    "--concurrency", "4", "--seed", "0", "--output", str(out),
                ]  # fmt: skip
                rc = run(parse_config(args), Console(file=io.StringIO()))
                hits1, queries1 = prefix_counters(url)
                peak = vm_hwm_mb(proc.pid)
            finally:
                stop_server(proc, 60)
        if rc != 0:
            raise RuntimeError(f"inferd bench failed (caching={caching})")
        r = json.loads(out.read_text())
    return {
        "median_ttft_ms": r["median_ttft_ms"],
        "mean_ttft_ms": r["mean_ttft_ms"],
        "p99_ttft_ms": r["p99_ttft_ms"],
        "duration_s": r["duration"],
        "completed": r["completed"],
        "failed": r["failed"],
        "mean_input_tokens": sum(r["input_lens"]) / len(r["input_lens"]),
        "hit_rate": (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
        "peak_rss_mb": round(peak, 1) if peak is not None else None,
        "bench_command": "inferd " + " ".join(args).replace(url, "URL").replace(str(out), "OUT.json"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    off = run_side(False, a)
    on = run_side(True, a)
    result = {
        "benchmark": "prefix_cache",
        "workload": f"8 system prompts of 1000 tokens x {a.num_prompts // 8} questions of 32 tokens, 8 output tokens, concurrency 4",
        "ttft_off_ms": off["median_ttft_ms"],
        "ttft_on_ms": on["median_ttft_ms"],
        "ttft_speedup": off["median_ttft_ms"] / on["median_ttft_ms"],
        "hit_rate": on["hit_rate"],
        "off": off,
        "on": on,
        "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} nproc={__import__('os').cpu_count()}",
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median TTFT: off {off['median_ttft_ms']:.0f} ms, on {on['median_ttft_ms']:.0f} ms "
          f"-> {result['ttft_speedup']:.1f}x; hit rate {on['hit_rate']:.1%}; "
          f"peak RSS off {off['peak_rss_mb']} MB, on {on['peak_rss_mb']} MB")  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
