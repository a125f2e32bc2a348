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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
HEALTH_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"inferd serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"inferd serve not healthy after {HEALTH_TIMEOUT_S}s")


def vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def bench_args(url: str, a: argparse.Namespace) -> list[str]:
    return [
        "bench", url,
        "--sweep", "--sweep-rates", a.rates,
        "--slo", a.slo, "--slo-attainment", "0.9",
        "--num-prompts", str(a.num_prompts), "--input-len", "256", "--output-len", "64",
        "--burstiness", "1", "--seed", "0", "--cost-per-hour", str(a.cost_per_hour),
        "--output", str(RESULTS / "serving_sweep.json"), "--plot", str(RESULTS / "serving_sweep.png"),
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,1.5,2,3,4", help="requests/s per sweep step")
    ap.add_argument("--num-prompts", type=int, default=24, help="requests per step")
    ap.add_argument("--slo", default="ttft=1000,tpot=150")
    ap.add_argument("--cost-per-hour", type=float, default=0.10, help="USD per hour of this machine (an assumption)")
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
        wait_healthy(url, proc)
        args = bench_args(url, a)
        cfg = parse_config(args)
        buffer = io.StringIO()
        console = Console(file=buffer, width=140, force_terminal=False)
        rc = run(cfg, console)
        table = buffer.getvalue()
        print(table)
        peak = vm_hwm_mb(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        os.unlink(log.name)
    result_path = RESULTS / "serving_sweep.json"
    result = json.loads(result_path.read_text())
    result["server_peak_rss_mb"] = round(peak, 1) if peak is not None else None
    result["command"] = "python benchmarks/serving_sweep.py " + " ".join(sys.argv[1:])
    result["bench_command"] = "inferd " + " ".join(args).replace(url, "URL").replace(f"{ROOT}/", "")
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "serving_sweep.txt").write_text(table)
    print(f"server peak RSS {peak:.0f} MB; wrote {result_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
