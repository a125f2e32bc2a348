"""Batch inference: ``inferd batch`` against the same requests sent online,
and interactive latency while a batch job runs.

  * offline: ``--num-requests`` random prompts of ``--input-len`` tokens x
    ``--output-len`` tokens (EOS ignored) as an OpenAI batch file through
    ``inferd batch`` (its own process; wall time from launch to exit, model
    load included, and its own time from the model loaded to the last result).
  * online: the same prompts sent by ``inferd bench``'s client at
    ``--concurrency`` 32 to ``inferd serve`` (same engine flags); output
    tokens over the wall time of the load.
  * interactive under batch: ``--interactive`` requests at concurrency 4 to
    ``inferd serve`` alone, then again while a batch job (``POST /v1/batches``,
    ``--background`` lines) runs on the same server at lower priority:
    TTFT p50/p95 both ways.

The offline phase runs with no server up, so the two throughput phases never
share the CPU. Peak RSS of each process is its VmHWM.

    python benchmarks/batch_throughput.py [--num-requests 1000] [--engine-args "--quantization int4"]

Writes benchmarks/results/batch_throughput.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx

from inferd.bench.client import Api, count_tokens, send
from inferd.bench.datasets import random_requests
from inferd.bench.load import run_load
from inferd.bench.metrics import summarize

ROOT = Path(__file__).resolve().parent
MODEL = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class Server:
    def __init__(self, engine_args: list[str], data_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inferd.cli", "serve", "--port", str(self.port), "--served-model-name", MODEL,
             "--data-dir", str(data_dir), *engine_args],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inferd serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("inferd serve not healthy")

    def stop(self) -> float | None:
        rss = peak_rss_mb(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        return rss


async def load(url: str, reqs: list, concurrency: int) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, pool=None)) as client:
        api = Api(url, "completions", MODEL)
        t0 = time.perf_counter()
        results = await run_load(reqs, lambda r: send(client, api, r, t0), [0.0] * len(reqs), concurrency)
        wall = time.perf_counter() - t0
    m = summarize(results, wall)
    return {
        "completed": m.completed, "failed": m.failed, "duration_s": round(m.duration, 2),
        "output_tokens": m.total_output_tokens, "output_tok_s": round(m.output_throughput, 2),
        "ttft_p50_ms": round(m.ttft.median, 1) if m.ttft.median is not None else None,
        "ttft_p95_ms": round(m.ttft.p95, 1) if m.ttft.p95 is not None else None,
        "tpot_p50_ms": round(m.tpot.median, 2) if m.tpot.median is not None else None,
    }  # fmt: skip


def batch_file(path: Path, reqs: list, output_len: int) -> None:
    with open(path, "w") as f:
        for i, r in enumerate(reqs):
            body = {"model": MODEL, "prompt": r.prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def run_offline(path: Path, out: Path, engine_args: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "batch", str(path), str(out), "--no-progress", *engine_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    rss = None
    while proc.poll() is None:
        rss = peak_rss_mb(proc.pid) or rss
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"inferd batch failed: {proc.stderr.read()}")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(entry["response"]["body"]["usage"]["completion_tokens"] for entry in lines)
    # inferd batch reports its own time from the model loaded to the last result.
    match = re.search(r"output tokens in ([0-9.]+)s after the model loaded", proc.stderr.read())
    running = float(match.group(1)) if match else wall
    return {
        "answered": len(lines), "output_tokens": tokens, "wall_s": round(wall, 2), "after_load_s": running,
        "output_tok_s_wall": round(tokens / wall, 2),
        "output_tok_s_after_load": round(tokens / running, 2), "peak_rss_mb": rss,
    }  # fmt: skip


def background_batch(url: str, reqs: list, output_len: int, tmp: Path) -> str:
    import openai

    path = tmp / "background.jsonl"
    batch_file(path, reqs, output_len)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with open(path, "rb") as f:
        upload = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # running, and past its first results
        b = client.batches.retrieve(batch.id)
        if b.status == "in_progress" and b.request_counts and b.request_counts.completed >= 2:
            return batch.id
        time.sleep(0.2)
    raise RuntimeError(f"batch {batch.id} did not start: {b.status}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--interactive", type=int, default=24, help="interactive requests per latency phase")
    p.add_argument("--interactive-output-len", type=int, default=32)
    p.add_argument("--background", type=int, default=400, help="lines of the batch job behind the interactive load")
    p.add_argument("--engine-args", default="--kv-cache-memory-gb 1 --max-model-len 1024", help="flags for both serve and batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(ROOT / "results" / "batch_throughput.json"))
    a = p.parse_args()
    engine_args = shlex.split(a.engine_args)
    tmp = Path(tempfile.mkdtemp(prefix="inferd-batch-bench-"))
    result: dict = {"params": vars(a), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}

    # Prompts of exact token lengths, counted by a server's /tokenize.
    server = Server(engine_args, tmp / "data0", tmp / "serve0.log")
    try:
        async def make(n: int, output_len: int, seed: int) -> list:
            async with httpx.AsyncClient(timeout=60) as client:
                reqs, exact = await random_requests(n, a.input_len, output_len, 0.0, seed, partial(count_tokens, client, server.url, MODEL))
            assert exact
            return reqs

        reqs = asyncio.run(make(a.num_requests, a.output_len, a.seed))
        interactive = asyncio.run(make(a.interactive, a.interactive_output_len, a.seed + 1))
        background = asyncio.run(make(a.background, a.output_len, a.seed + 2))
    finally:
        server.stop()
    for r in reqs + interactive:
        r.ignore_eos = True

    batch_file(tmp / "in.jsonl", reqs, a.output_len)
    print(f"offline: {a.num_requests} requests through inferd batch ...", flush=True)
    result["offline"] = run_offline(tmp / "in.jsonl", tmp / "out.jsonl", engine_args)
    print(json.dumps(result["offline"]), flush=True)

    server = Server(engine_args, tmp / "data1", tmp / "serve1.log")
    try:
        asyncio.run(load(server.url, interactive[:4], 4))  # warm-up
        print(f"online: the same requests at concurrency {a.concurrency} ...", flush=True)
        result["online"] = asyncio.run(load(server.url, reqs, a.concurrency))
        print(json.dumps(result["online"]), flush=True)
        result["interactive_alone"] = asyncio.run(load(server.url, interactive, 4))
        batch_id = background_batch(server.url, background, a.output_len, tmp)
        result["interactive_with_batch"] = asyncio.run(load(server.url, interactive, 4))
        import openai

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        status = client.batches.retrieve(batch_id)
        # Still running when the interactive load ended, or the comparison is void.
        result["background_batch"] = {"id": batch_id, "status_after_interactive": status.status,
                                      "completed_lines": status.request_counts.completed if status.request_counts else None}
        if status.status == "in_progress":
            client.batches.cancel(batch_id)
    finally:
        result["serve_peak_rss_mb"] = server.stop()

    off, on = result["offline"], result["online"]
    result["batch_vs_online_wall"] = round(off["output_tok_s_wall"] / on["output_tok_s"], 3)
    result["batch_vs_online_after_load"] = round(off["output_tok_s_after_load"] / on["output_tok_s"], 3)
    alone, busy = result["interactive_alone"], result["interactive_with_batch"]
    result["interactive_ttft_p50_ratio"] = round(busy["ttft_p50_ms"] / alone["ttft_p50_ms"], 3)
    result["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    Path(a.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"batch {off['output_tok_s_after_load']} tok/s after load ({off['output_tok_s_wall']} with it) vs online "
          f"{on['output_tok_s']} tok/s: {result['batch_vs_online_after_load']}x; interactive TTFT p50 {alone['ttft_p50_ms']} ms alone, "
          f"{busy['ttft_p50_ms']} ms beside a batch job ({result['interactive_ttft_p50_ratio']}x)")


if __name__ == "__main__":
    main()
