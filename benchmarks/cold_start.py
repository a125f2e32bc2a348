"""Cold start: from launching ``inferd serve`` to healthy and to a first token.

Starts the server on the default model ``--runs`` times one after another in
this invocation. Each run records the seconds from spawning the process to
``/health`` answering 200 (polled every 20 ms), to the first streamed token of
one completion sent right then, the server's own
``inferd:model_load_time_seconds`` (engine construction: read, dequantize,
build, allocate), and peak RSS. The first run pays for a cold OS page cache
where there is one (this script cannot drop it); later runs are the "second
start" a restarted or scaled-up replica sees. The runs share a kernel cache
(``XDG_CACHE_HOME``) that is empty before the first: the first start
compiles inferd's C kernels while it loads, later ones load
them. The baseline for the ratio is
the bare interpreter importing torch in the same invocation: the part of a
start no change to inferd can remove.

    python benchmarks/cold_start.py [--runs 3] [--out PATH]

Writes benchmarks/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _server import free_port, log_tail, stop_server, vm_hwm_mb  # the script's folder

RESULTS = Path(__file__).parent / "results" / "cold_start.json"
TIMEOUT_S = 180.0
POLL_S = 0.02


def wait_health(url: str, proc: subprocess.Popen, start: float) -> float:
    deadline = start + TIMEOUT_S
    with httpx.Client(timeout=1.0) as c:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                if c.get(f"{url}/health").status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"not healthy after {TIMEOUT_S:.0f}s")


def first_token(url: str, start: float) -> float:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - start
    raise RuntimeError("stream ended without a token")


def load_time(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("inferd:model_load_time_seconds{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no inferd:model_load_time_seconds in /metrics")


def one_start(extra: list[str], env: dict[str, str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferd", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "wb") as log:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                healthy = wait_health(url, proc, start)
                token = first_token(url, start)
                loaded = load_time(url)
                peak = vm_hwm_mb(proc.pid)
            except Exception as e:
                raise RuntimeError(f"{e}\n{log_tail(log_path)}") from e
            finally:
                stop_server(proc, 30)
    return {"healthy_s": healthy, "first_token_s": token, "model_load_s": loaded, "peak_rss_mb": peak}


def import_torch_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("serve_args", nargs="*", help="extra `inferd serve` flags, after --")
    a = ap.parse_args()
    baseline = statistics.median(import_torch_s() for _ in range(3))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        runs = [one_start(a.serve_args, env) for _ in range(a.runs)]
    later = runs[1:] or runs
    second = statistics.median(r["healthy_s"] for r in later)
    result = {
        "benchmark": "cold_start",
        "server": "inferd serve " + " ".join(a.serve_args) if a.serve_args else "inferd serve (default model)",
        "first_start_healthy_s": runs[0]["healthy_s"],
        "first_start_first_token_s": runs[0]["first_token_s"],
        "kernel_cache": "empty before the first start (it compiles the C kernels); later starts load them",
        "second_start_healthy_s": second,
        "second_start_first_token_s": statistics.median(r["first_token_s"] for r in later),
        "model_load_s": statistics.median(r["model_load_s"] for r in later),
        "import_torch_s": baseline,
        "ratio_vs_import_torch": second / baseline,
        "runs": runs,
        "command": "python benchmarks/cold_start.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} nproc={os.cpu_count()}",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"first start healthy in {runs[0]['healthy_s']:.2f}s; second start healthy in {second:.2f}s, "
        f"first token at {result['second_start_first_token_s']:.2f}s, model load {result['model_load_s']:.2f}s "
        f"(import torch alone {baseline:.2f}s: {result['ratio_vs_import_torch']:.1f}x)"
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
