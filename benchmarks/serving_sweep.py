"""A request-rate sweep of ``inferd bench`` against ``inferd serve``.

Starts ``inferd serve`` on the default model (default settings) on a free
loopback port, runs ``inferd bench --sweep`` against it (Poisson arrivals,
synthetic prompts of 256 tokens, 64 output tokens, rising rates until the
SLO fails), records the server's peak RSS, stops it with SIGTERM, and
writes:

    benchmarks/results/serving_sweep.json   the bench JSON + server peak RSS
    benchmarks/results/serving_sweep.png    latency percentiles vs achieved rate
    benchmarks/results/serving_sweep.txt    the table as printed

    python benchmarks/serving_sweep.py [--rates 0.5,1,1.5,2,3,4] [--num-prompts 24]

``benchmarks/serving.md`` quotes the result.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _server import free_port, stop_server, vm_hwm_mb, wait_healthy  # the script's folder

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
HEALTH_TIMEOUT_S = 180


def bench_args(url: str, a: argparse.Namespace) -> list[str]:
    return [
        "bench", url,
        "--sweep", "--sweep-rates", a.rates,
        "--slo", a.slo, "--slo-attainment", "0.9",
        "--num-prompts", str(a.num_prompts), "--input-len", "256", "--output-len", "64",
        "--burstiness", "1", "--seed", "0", "--cost-per-hour", str(a.cost_per_hour),
        "--output", str(a.out_dir / "serving_sweep.json"), "--plot", str(a.out_dir / "serving_sweep.png"),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,1.5,2,3,4", help="requests/s per sweep step")
    ap.add_argument("--num-prompts", type=int, default=24, help="requests per step")
    ap.add_argument("--slo", default="ttft=1000,tpot=150")
    ap.add_argument("--cost-per-hour", type=float, default=0.10, help="USD per hour of this machine (an assumption)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where the three files go")
    a = ap.parse_args()

    from rich.console import Console

    from inferd.bench.main import run
    from inferd.cli import parse_config

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+b", prefix="inferd-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    try:
        wait_healthy(url, proc, HEALTH_TIMEOUT_S)
        args = bench_args(url, a)
        cfg = parse_config(args)
        buffer = io.StringIO()
        console = Console(file=buffer, width=140, force_terminal=False)
        rc = run(cfg, console)
        table = buffer.getvalue()
        print(table)
        peak = vm_hwm_mb(proc.pid)
    finally:
        stop_server(proc, 60)
        log.close()
        os.unlink(log.name)
    result_path = a.out_dir / "serving_sweep.json"
    result = json.loads(result_path.read_text())
    result["server_peak_rss_mb"] = round(peak, 1) if peak is not None else None
    result["command"] = "python benchmarks/serving_sweep.py " + " ".join(sys.argv[1:])
    result["bench_command"] = "inferd " + " ".join(args).replace(url, "URL").replace(f"{ROOT}/", "")
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    (a.out_dir / "serving_sweep.txt").write_text(table)
    print(f"server peak RSS {peak:.0f} MB; wrote {result_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
