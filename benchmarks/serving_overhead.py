"""Serving overhead: the HTTP server against the offline engine, same requests.

64 prompts of mixed length (16-512 tokens, the token ids offline_throughput.py
uses) x 128 output tokens (greedy, EOS ignored) on the default model, run
twice in one invocation, one side after the other:
  * server: ``inferd serve --max-num-seqs 32`` in a subprocess, driven by 32
    concurrent streaming clients (asyncio + httpx) posting the token ids to
    ``/v1/completions`` with ``stream=true`` and
    ``stream_options.include_usage``; output tokens are the usage chunks'
    ``completion_tokens``, the time runs from the first request sent to the
    last stream's ``[DONE]``;
  * offline: ``LLM(max_num_seqs=32).generate()`` over the same prompts, in a
    child process.
Both sides batch at most 32 requests with the same engine settings (and both
detokenize), so the gap is what HTTP, JSON, SSE and the async engine's step
thread cost; prompts go as token ids, so prompt tokenization is left out,
and both sides see the same tokens. The target is server tok/s >= 85% of offline tok/s. The load
generator shares the machine's cores with the server, as a local client
would, so its own parsing is counted against the server; it is kept light
(raw SSE lines and ``json.loads``, no SDK objects) for that reason.

Each side's peak RSS is its own: the server's is its VmHWM, read from /proc
before it is stopped (null off Linux); the offline side's is the child's
ru_maxrss. Server TTFT (send -> first chunk with a choice) is reported as
p50 and p90. ``--threads`` sets torch's intra-op threads on both sides:
on a machine with few cores, the server's event loop and the clients compete
with the engine's threads for them, which the offline side never does.

    python benchmarks/serving_overhead.py [--dtype auto|float32|bfloat16] [--quick] [--out PATH]

Writes benchmarks/results/serving_overhead.json (--quick: a smoke test of 8
prompts x 16 tokens, 4 clients; written to the temp directory unless --out
is given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from _server import free_port, log_tail, stop_server, vm_hwm_mb, wait_healthy  # noqa: E402 - the script's folder

RESULTS = Path(__file__).parent / "results" / "serving_overhead.json"
QUICK_RESULTS = Path(tempfile.gettempdir()) / "serving_overhead_quick.json"
VOCAB = 49152  # the default model's
TARGET_RATIO = 0.85
HEALTH_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 600.0  # per request, and the bound on each side's whole run
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")


# Workload -------------------------------------------------------------------------


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The same prompts as offline_throughput.py's for the same arguments."""
    rng = random.Random(seed)
    # Ids above the special tokens at the start of the vocabulary.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int
    max_num_seqs: int
    dtype: str
    threads: int | None  # torch intra-op threads; None: torch's default


# Offline side (child process) ----------------------------------------------------


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_offline(work: Workload, results: mp.Queue) -> None:
    from inferd import LLM, SamplingParams

    llm = LLM(dtype=work.dtype, max_num_seqs=work.max_num_seqs, num_threads=work.threads)
    llm.generate(work.prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    results.put(
        {
            "elapsed_s": elapsed,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "texts": [o.outputs[0].text for o in outs],
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "peak_rss_mb": peak_rss_mb(),
        }
    )


def in_child(target: Any, *args: Any, timeout_s: float) -> dict:
    """``target(*args, queue)`` in a spawned process; its one result, or an
    error if it dies or runs past ``timeout_s``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"offline child exited with code {proc.exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"offline child gave no result within {timeout_s:.0f}s") from None
        proc.join(timeout=SHUTDOWN_TIMEOUT_S)
        return result
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


# Server process -------------------------------------------------------------------


def server_command(port: int, work: Workload) -> list[str]:
    cmd = [
        sys.executable, "-m", "inferd", "serve",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-num-seqs", str(work.max_num_seqs),
        "--dtype", work.dtype,
    ]  # fmt: skip
    return cmd if work.threads is None else [*cmd, "--threads", str(work.threads)]


# Streaming clients -------------------------------------------------------------


@dataclass
class StreamResult:
    completion_tokens: int
    chunks: int
    ttft_s: float
    elapsed_s: float
    text: str
    system_fingerprint: str | None


async def stream_completion(client: Any, model: str, prompt: list[int], max_tokens: int) -> StreamResult:
    """One streamed completion; raises on an HTTP error, an error event, or a
    stream that ends without its usage chunk or ``[DONE]``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    chunks, usage, fingerprint, done = 0, None, None, False
    text: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event mid-stream: {event['error']}")
            if event["choices"]:
                chunks += 1
                text.append(event["choices"][0]["text"])
                if ttft is None:
                    ttft = time.perf_counter() - start
            elif event.get("usage") is not None:
                usage = event["usage"]
            fingerprint = event.get("system_fingerprint", fingerprint)
    if not done or usage is None or ttft is None:
        raise RuntimeError(f"stream ended early (done={done}, usage={usage}, chunks={chunks})")
    return StreamResult(
        completion_tokens=usage["completion_tokens"],
        chunks=chunks,
        ttft_s=ttft,
        elapsed_s=time.perf_counter() - start,
        text="".join(text),
        system_fingerprint=fingerprint,
    )


async def served_model(client: Any) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_clients(base_url: str, work: Workload) -> tuple[list[StreamResult], float]:
    """Warm up, then every prompt with at most ``concurrency`` streams open;
    the results in prompt order and the wall time of the measured part."""
    import httpx

    limits = httpx.Limits(max_connections=work.concurrency, max_keepalive_connections=work.concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        model = await served_model(client)
        await asyncio.gather(*(stream_completion(client, model, p[:16], 4) for p in work.prompts[:2]))
        gate = asyncio.Semaphore(work.concurrency)

        async def one(prompt: list[int]) -> StreamResult:
            async with gate:
                return await stream_completion(client, model, prompt, work.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in work.prompts))
        return list(results), time.perf_counter() - start


def run_server_side(work: Workload) -> dict:
    """Start the server, load it, stop it; it is killed whatever happens."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = server_command(port, work)
    with tempfile.NamedTemporaryFile("w+b", prefix="inferd-serve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_healthy(base_url, proc, HEALTH_TIMEOUT_S)
        results, elapsed = asyncio.run(asyncio.wait_for(run_clients(base_url, work), REQUEST_TIMEOUT_S))
        peak = vm_hwm_mb(proc.pid)
        exit_code = stop_server(proc, SHUTDOWN_TIMEOUT_S)
    except BaseException:
        print(f"server log ({log_path}), last lines:\n{log_tail(log_path)}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    log_path.unlink(missing_ok=True)
    fingerprint = results[0].system_fingerprint or ""
    return {
        "command": shlex.join(cmd),
        "elapsed_s": elapsed,
        "output_tokens": sum(r.completion_tokens for r in results),
        "chunks": sum(r.chunks for r in results),
        "per_request_tokens": sorted({r.completion_tokens for r in results}),
        "ttft_s": [r.ttft_s for r in results],
        "texts": [r.text for r in results],
        "dtype": fingerprint.removeprefix("inferd-") or None,
        "peak_rss_mb": peak,
        "exit_code": exit_code,
    }


# Report ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine_info() -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "machine": f"{platform.machine()} {platform.processor() or ''} nproc={os.cpu_count()}".replace("  ", " "),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "uvicorn": version("uvicorn"),
        "httpx": version("httpx"),
        # Thread settings both sides inherit; they change the result on a small machine.
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }


def round_or_none(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def build_result(work: Workload, server: dict, offline: dict, quick: bool) -> dict[str, Any]:
    server_tok_s = server["output_tokens"] / server["elapsed_s"]
    offline_tok_s = offline["output_tokens"] / offline["elapsed_s"]
    ratio = server_tok_s / offline_tok_s
    same = sum(a == b for a, b in zip(server["texts"], offline["texts"]))
    return {
        "benchmark": "serving_overhead",
        "quick": quick,
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "dtype": offline["dtype"],
        "server_dtype": server["dtype"],
        "num_prompts": len(work.prompts),
        "prompt_tokens": sum(map(len, work.prompts)),
        "max_tokens": work.max_tokens,
        "concurrency": work.concurrency,
        "max_num_seqs": work.max_num_seqs,
        "threads": work.threads,
        "server_tok_s": round(server_tok_s, 2),
        "offline_tok_s": round(offline_tok_s, 2),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "server_elapsed_s": round(server["elapsed_s"], 2),
        "offline_elapsed_s": round(offline["elapsed_s"], 2),
        "server_output_tokens": server["output_tokens"],
        "offline_output_tokens": offline["output_tokens"],
        "server_stream_chunks": server["chunks"],
        "server_ttft_p50_s": round(statistics.median(server["ttft_s"]), 3),
        "server_ttft_p90_s": round(percentile(server["ttft_s"], 0.9), 3),
        # Greedy on both sides, but batches differ, so float rounding may
        # (rarely) flip a token: informative, not a pass/fail check.
        "identical_texts": f"{same}/{len(work.prompts)}",
        "server_peak_rss_mb": round_or_none(server["peak_rss_mb"], 1),
        "offline_peak_rss_mb": round(offline["peak_rss_mb"], 1),
        "server_exit_code": server["exit_code"],
        "server_command": server["command"],
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        **machine_info(),
        "date": time.strftime("%Y-%m-%d"),
    }


def check_counts(work: Workload, server: dict, offline: dict) -> None:
    """ignore_eos: every request must produce exactly max_tokens on both sides."""
    expected = len(work.prompts) * work.max_tokens
    for side, got in (("server", server["output_tokens"]), ("offline", offline["output_tokens"])):
        if got != expected:
            print(f"warning: {side} produced {got} output tokens, expected {expected}", file=sys.stderr)
    if server["per_request_tokens"] != [work.max_tokens]:
        got = server["per_request_tokens"]
        print(f"warning: server usage.completion_tokens per request {got}, expected [{work.max_tokens}]", file=sys.stderr)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32, help="streaming clients in flight at once")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="the engine's batch limit, on both sides")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads, on both sides (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, 4 clients, to check the script runs")
    ap.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} ({QUICK_RESULTS} with --quick)")
    a = ap.parse_args()
    if a.quick:
        a.num_prompts, a.max_tokens, a.concurrency, a.max_num_seqs = 8, 16, 4, 4
    if a.out is None:
        a.out = QUICK_RESULTS if a.quick else RESULTS
    return a


def main() -> None:
    a = parse_args()
    work = Workload(
        prompts=make_prompts(a.num_prompts, 16, 512, vocab=VOCAB),
        max_tokens=a.max_tokens,
        concurrency=a.concurrency,
        max_num_seqs=a.max_num_seqs,
        dtype=a.dtype,
        threads=a.threads,
    )
    print(
        f"{len(work.prompts)} prompts, {sum(map(len, work.prompts))} prompt tokens, {work.max_tokens} output "
        f"tokens each; {work.concurrency} clients, max_num_seqs {work.max_num_seqs}, dtype {work.dtype}, "
        f"threads {work.threads or 'default'}"
    )
    server = run_server_side(work)
    server_tok_s = server["output_tokens"] / server["elapsed_s"]
    rss = f"{server['peak_rss_mb']:.0f} MB" if server["peak_rss_mb"] is not None else "n/a"
    print(f"server:  {server_tok_s:8.1f} tok/s  ({server['elapsed_s']:.1f}s, peak RSS {rss})")
    offline = in_child(run_offline, work, timeout_s=REQUEST_TIMEOUT_S + HEALTH_TIMEOUT_S)
    offline_tok_s = offline["output_tokens"] / offline["elapsed_s"]
    print(f"offline: {offline_tok_s:8.1f} tok/s  ({offline['elapsed_s']:.1f}s, peak RSS {offline['peak_rss_mb']:.0f} MB)")
    check_counts(work, server, offline)

    result = build_result(work, server, offline, a.quick)
    verdict = "meets" if result["meets_target"] else "misses"
    print(
        f"ratio:   {result['ratio']:8.3f}  ({verdict} the {TARGET_RATIO:.0%} target; server TTFT p50 "
        f"{result['server_ttft_p50_s']:.2f}s; identical texts {result['identical_texts']})"
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
