"""Gateway overhead: load straight at two replicas against the same load
through ``inferd gateway``; then prefix-affine routing against round robin.

Two ``inferd serve`` replicas of the default model (one torch thread each,
``--served-model-name smol``) serve every phase; the gateway (auth off) lists
them as ``upstreams``. The load is ``inferd bench``'s own client (its prompt
builder, ``run_load`` and ``send``), run in this process:

  * overhead: ``--num-prompts`` random prompts of ``--input-len`` tokens x
    ``--output-len`` tokens (EOS ignored), ``--concurrency`` streams. Direct:
    two clients at concurrency/2 at once, the even prompts to one replica and
    the odd ones to the other; throughput is all output tokens over the wall
    time of the whole phase and TTFT p50 is over every request of both.
    Gateway: one client at full concurrency through a gateway routing by
    ``--overhead-policy`` (round_robin: the same even split). The phases
    alternate direct/gateway, then gateway/direct, ``--repeats`` times; each
    phase has its own prompt set of the same token lengths (seed, seed+1, ...),
    so no phase finds another's prompts in a replica's prefix cache (the
    per-phase hit rate is recorded to show it). Reported: each phase and the
    median over repeats; the overheads are of the medians.
  * proxy overhead: ``--micro-requests`` sequential non-streaming requests of
    one output token to an idle pool, direct and via the gateway in turn; the
    median of the paired differences is the gateway's own per-request cost,
    free of the batching noise that dominates TTFT under load.
  * prefix routing: ``--sp-prefixes`` system prompts of ``--sp-prefix-len``
    tokens x ``--sp-prompts`` questions (``inferd bench --dataset
    shared-prefix``), through the gateway with ``prefix_affinity``, then with
    ``round_robin``; the replicas are restarted before each of the two phases,
    so both start from an empty prefix cache and see the same prompts. The
    default, 16 prefixes of 1,000 tokens, is more than one replica's KV cache
    holds (0.5 GB: 728 blocks of 16 tokens, 11,648 tokens, in float32) and
    less than two hold: affinity keeps each prefix on one replica, round robin
    makes both hold all of them and evict. With 8 prefixes each replica
    holds all of them anyway and round robin only pays one more miss per prefix.
    Reported: TTFT p50/p95, each replica's prefix-cache hit rate
    (``inferd:prefix_cache_hits_total / inferd:prefix_cache_queries_total``)
    and request count, the gateway's routing decisions, and
    ``affinity_ttft_speedup = rr TTFT p50 / affinity TTFT p50``.

Client, gateway and replicas share the machine's cores, so the gateway's CPU
time is taken from the replicas: on a small machine that is part of its cost.
Peak RSS is each process's VmHWM, read before it stops.

    python benchmarks/gateway_overhead.py [--num-prompts 64] [--repeats 2] [--output PATH]

Writes benchmarks/results/gateway_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml
from _server import free_port, log_tail, stop_server, vm_hwm_mb, wait_healthy  # the script's folder
from prometheus_client.parser import text_string_to_metric_families

from inferd.bench.client import Api, count_tokens, send
from inferd.bench.datasets import random_requests, shared_prefix_requests
from inferd.bench.load import run_load
from inferd.bench.metrics import summarize
from inferd.bench.records import BenchRequest, RequestResult

RESULTS = Path(__file__).parent / "results" / "gateway_overhead.json"
MODEL = "smol"
TARGET_TTFT_OVERHEAD_MS = 10.0
TARGET_THROUGHPUT_OVERHEAD_PCT = 5.0
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0  # without a byte
WARMUP_REQUESTS = 3  # per replica, and through each gateway
KV_LINE = re.compile(r"(\d+) KV blocks of (\d+) tokens")


# Processes -------------------------------------------------------------------------


class Fleet:
    """The replicas and gateways this run started, each with its log; stop_all() ends them."""

    def __init__(self, tmp: Path, threads: int) -> None:
        self.tmp, self.threads = tmp, threads
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = (proc, log_path)
        return proc

    def start_replicas(self, tag: str) -> list[str]:
        urls, procs = [], []
        for i in range(2):
            port = free_port()
            cmd = [
                sys.executable, "-m", "inferd.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", MODEL, "--kv-cache-memory-gb", "0.5", "--max-model-len", "2048",
                "--threads", str(self.threads),
            ]  # fmt: skip
            procs.append(self._start(f"replica{i}-{tag}", cmd))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc, START_TIMEOUT_S)
        return urls

    def start_gateway(self, tag: str, upstreams: list[str], policy: str) -> str:
        config = {
            "auth": {"enabled": False},
            "routing": {"policy": policy},
            "models": [{"name": MODEL, "upstreams": upstreams, "tokenizer": "default"}],
        }
        config_path = self.tmp / f"gateway-{tag}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        data_dir = self.tmp / f"gateway-{tag}-data"
        cmd = [sys.executable, "-m", "inferd.cli", "gateway", "-c", str(config_path), "--host", "127.0.0.1",
               "--port", str(port), "--data-dir", str(data_dir)]  # fmt: skip
        proc = self._start(f"gateway-{tag}", cmd)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # /health answers at once; wait until it routes to both replicas
            ready = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["replicas"].get("ready", 0)
            if ready == len(upstreams):
                return url
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway {tag}: {ready}/{len(upstreams)} replicas ready (exit code {proc.poll()})")
            time.sleep(0.2)

    def kv_cache_tokens(self, prefix: str) -> dict[str, int | None]:
        """Each replica's KV-cache capacity, from its start-up log line."""
        out = {}
        for name, (_, log_path) in self.procs.items():
            if name.startswith(prefix):
                m = KV_LINE.search(log_path.read_text(errors="replace"))
                out[name] = int(m[1]) * int(m[2]) if m else None
        return out

    def peak_mb(self, prefix: str) -> dict[str, float | None]:
        return {name: round_or_none(vm_hwm_mb(p.pid), 1) for name, (p, _) in self.procs.items() if name.startswith(prefix)}

    def stop(self, prefix: str) -> None:
        for name in [n for n in self.procs if n.startswith(prefix)]:
            proc, _ = self.procs.pop(name)
            stop_server(proc, 30)

    def stop_all(self, show_logs: bool) -> None:
        for name, (proc, log_path) in list(self.procs.items()):
            if show_logs:
                print(f"--- {name} log ({log_path}), last lines:\n{log_tail(log_path)}", file=sys.stderr)
            stop_server(proc, 30)
        self.procs.clear()


# Load --------------------------------------------------------------------------------


async def make_requests(url: str, kind: str, a: argparse.Namespace, seed: int) -> list[BenchRequest]:
    """``inferd bench``'s prompts, counted exactly by a replica's /tokenize."""
    async with httpx.AsyncClient(timeout=60) as client:
        count = partial(count_tokens, client, url, MODEL)
        if kind == "shared-prefix":
            reqs, exact = await shared_prefix_requests(
                a.sp_prompts, a.sp_prefixes, a.sp_prefix_len, a.sp_question_len, a.sp_output_len, seed, count, chat=False
            )
        else:
            reqs, exact = await random_requests(a.num_prompts, a.input_len, a.output_len, 0.0, seed, count)
    if not exact:
        raise RuntimeError(f"{url} has no /tokenize: prompt lengths would be guesses")
    return reqs


async def drive(targets: list[tuple[str, list[BenchRequest], int]]) -> tuple[list[RequestResult], float]:
    """Every (url, requests, concurrency) at once, one client each; all results and the wall time."""
    clients = [
        httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, pool=None),
                          limits=httpx.Limits(max_connections=c, max_keepalive_connections=c))
        for _, _, c in targets
    ]  # fmt: skip
    try:
        t0 = time.perf_counter()
        loads = []
        for client, (url, reqs, conc) in zip(clients, targets):
            api = Api(url, "completions", MODEL)
            loads.append(run_load(reqs, lambda r, client=client, api=api: send(client, api, r, t0), [0.0] * len(reqs), conc))
        parts = await asyncio.gather(*loads)
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return [r for part in parts for r in part], wall


def warm_up(urls: list[str]) -> None:
    reqs = [BenchRequest("Hello, how are you today?", None, 8, ignore_eos=True)] * WARMUP_REQUESTS
    results, _ = asyncio.run(drive([(url, reqs, 1) for url in urls]))
    if not all(r.ok for r in results):
        raise RuntimeError(f"warm-up failed: {[r.error for r in results if not r.ok]}")


async def proxy_overhead(replicas: list[str], gateway: str, n: int) -> dict:
    """n sequential one-token requests each way, in turn; the per-request cost of the hop."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    direct, via = [], []
    async with httpx.AsyncClient(timeout=60) as client:

        async def timed(url: str) -> float:
            t = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return (time.perf_counter() - t) * 1000

        for i in range(n + WARMUP_REQUESTS):
            d, g = await timed(replicas[i % len(replicas)]), await timed(gateway)
            if i >= WARMUP_REQUESTS:
                direct.append(d)
                via.append(g)
    return {
        "requests": n,
        "direct_median_ms": round(statistics.median(direct), 2),
        "gateway_median_ms": round(statistics.median(via), 2),
        "overhead_ms": round(statistics.median(g - d for d, g in zip(direct, via)), 2),
    }


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(sample: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in sample.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def hit_rate(hits: float, queries: float) -> float | None:
    return round(hits / queries, 4) if queries else None


def replica_deltas(before: dict, after: dict) -> dict[str, float | None]:
    hits = delta(before, after, "inferd:prefix_cache_hits_total")
    queries = delta(before, after, "inferd:prefix_cache_queries_total")
    requests = delta(before, after, "inferd:request_success_total")
    return {"requests": int(requests), "prefix_cache_hit_rate": hit_rate(hits, queries)}


def phase(replicas: list[str], targets: list[tuple[str, list[BenchRequest], int]]) -> dict[str, Any]:
    """One measured load, summarized as ``inferd bench`` would, with the replicas' cache counters."""
    before = [scrape(u) for u in replicas]
    results, wall = asyncio.run(drive(targets))
    after = [scrape(u) for u in replicas]
    m = summarize(results, wall)
    per_replica = [replica_deltas(b, a) for b, a in zip(before, after)]
    hits = sum(delta(b, a, "inferd:prefix_cache_hits_total") for b, a in zip(before, after))
    queries = sum(delta(b, a, "inferd:prefix_cache_queries_total") for b, a in zip(before, after))
    return {
        "completed": m.completed,
        "failed": m.failed,
        "errors": m.errors_by_kind,
        "duration_s": round(m.duration, 2),
        "output_tokens": m.total_output_tokens,
        "output_tok_s": round(m.output_throughput, 2),
        "ttft_p50_ms": round_or_none(m.ttft.median, 1),
        "ttft_p95_ms": round_or_none(m.ttft.p95, 1),
        "tpot_p50_ms": round_or_none(m.tpot.median, 2),
        "itl_p50_ms": round_or_none(m.itl.median, 2),
        "e2el_p50_ms": round_or_none(m.e2el.median, 1),
        "prefix_cache_hit_rate": hit_rate(hits, queries),
        "replicas": per_replica,
    }


# Report ------------------------------------------------------------------------------


def round_or_none(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def medians(runs: list[dict]) -> dict[str, float | None]:
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "itl_p50_ms", "e2el_p50_ms")
    return {k: round(statistics.median(r[k] for r in runs), 2) if all(r[k] is not None for r in runs) else None for k in keys}


def check(name: str, run: dict, expected_tokens: int) -> None:
    if run["failed"] or run["output_tokens"] != expected_tokens:
        print(f"warning: {name}: {run['failed']} failed {run['errors']}, {run['output_tokens']} output tokens "
              f"(expected {expected_tokens})", file=sys.stderr)  # fmt: skip


def print_summary(result: dict) -> None:
    o, p, s = result["overhead"], result["proxy_overhead"], result["prefix_routing"]
    d, g = o["direct"]["median"], o["gateway"]["median"]
    print(f"\n{'':22}{'direct':>10}{'gateway':>10}{'overhead':>12}   (median of {len(o['direct']['runs'])} runs)")
    print(f"{'output tok/s':22}{d['output_tok_s']:>10.1f}{g['output_tok_s']:>10.1f}{o['throughput_overhead_pct']:>11.1f}%"
          f"   target <= {TARGET_THROUGHPUT_OVERHEAD_PCT:g}%")  # fmt: skip
    print(f"{'TTFT p50 ms':22}{d['ttft_p50_ms']:>10.1f}{g['ttft_p50_ms']:>10.1f}{o['ttft_p50_overhead_ms']:>10.1f}ms"
          f"   target <= {TARGET_TTFT_OVERHEAD_MS:g} ms")  # fmt: skip
    print(f"{'TPOT p50 ms':22}{d['tpot_p50_ms']:>10.1f}{g['tpot_p50_ms']:>10.1f}")
    print(f"{'ITL p50 ms':22}{d['itl_p50_ms']:>10.1f}{g['itl_p50_ms']:>10.1f}")
    print(f"{'1-token request ms':22}{p['direct_median_ms']:>10.1f}{p['gateway_median_ms']:>10.1f}{p['overhead_ms']:>10.1f}ms"
          f"   (median of {p['requests']} paired, sequential)")  # fmt: skip
    aff, rr = s["prefix_affinity"], s["round_robin"]
    print(f"\n{'shared prefix':22}{'affinity':>10}{'rr':>10}")
    print(f"{'TTFT p50 ms':22}{aff['ttft_p50_ms']:>10.1f}{rr['ttft_p50_ms']:>10.1f}   speedup {s['affinity_ttft_speedup']:.2f}x")
    print(f"{'TTFT p95 ms':22}{aff['ttft_p95_ms']:>10.1f}{rr['ttft_p95_ms']:>10.1f}")
    hit = lambda r: "/".join(f"{x['prefix_cache_hit_rate'] or 0:.0%}" for x in r["replicas"])  # noqa: E731
    print(f"{'hit rate per replica':22}{hit(aff):>10}{hit(rr):>10}")
    print(f"{'requests per replica':22}{'/'.join(str(x['requests']) for x in aff['replicas']):>10}"
          f"{'/'.join(str(x['requests']) for x in rr['replicas']):>10}")  # fmt: skip
    print(f"\npeak RSS MB: {json.dumps(result['peak_rss_mb'])}")


# Run -------------------------------------------------------------------------------


def run_overhead(fleet: Fleet, a: argparse.Namespace) -> tuple[dict, dict, list[str]]:
    replicas = fleet.start_replicas("overhead")
    sets = [asyncio.run(make_requests(replicas[0], "random", a, a.seed + i)) for i in range(2 * a.repeats)]
    gateway = fleet.start_gateway("overhead", replicas, a.overhead_policy)
    warm_up([*replicas, gateway])
    print(f"replicas {replicas}, gateway {gateway} ({a.overhead_policy})")
    micro = asyncio.run(proxy_overhead(replicas, gateway, a.micro_requests))
    print(f"proxy overhead: {micro['overhead_ms']:.2f} ms per request (median of {a.micro_requests})")
    runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
    half = a.concurrency // 2
    for r in range(a.repeats):
        order = ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")
        for j, side in enumerate(order):
            reqs = sets[2 * r + j]
            if side == "direct":
                targets = [(replicas[0], reqs[0::2], half), (replicas[1], reqs[1::2], half)]
            else:
                targets = [(gateway, reqs, a.concurrency)]
            run = phase(replicas, targets)
            run.update(repeat=r, seed=a.seed + 2 * r + j)
            check(f"{side} run {r}", run, a.num_prompts * a.output_len)
            runs[side].append(run)
            print(f"{side:8} run {r}: {run['output_tok_s']:7.1f} tok/s, TTFT p50 {run['ttft_p50_ms']:8.1f} ms, "
                  f"TPOT p50 {run['tpot_p50_ms']:6.1f} ms, {run['failed']} failed, "
                  f"hit rate {run['prefix_cache_hit_rate']}")  # fmt: skip
    peaks = {**fleet.peak_mb("replica"), **fleet.peak_mb("gateway")}
    fleet.stop("gateway")
    fleet.stop("replica")
    d, g = medians(runs["direct"]), medians(runs["gateway"])
    ttft_over = g["ttft_p50_ms"] - d["ttft_p50_ms"]
    tput_over = 100 * (1 - g["output_tok_s"] / d["output_tok_s"])
    overhead = {
        "gateway_policy": a.overhead_policy,
        "prompts": "each phase its own random prompts (seed + phase index) of the same token lengths, "
        "so no phase hits another's prefixes in a replica's cache",
        "order": "direct then gateway in even repeats, gateway then direct in odd ones",
        "direct": {"runs": runs["direct"], "median": d},
        "gateway": {"runs": runs["gateway"], "median": g},
        "ttft_p50_overhead_ms": round(ttft_over, 1),
        "throughput_overhead_pct": round(tput_over, 2),
        "throughput_ratio": round(g["output_tok_s"] / d["output_tok_s"], 4),
        "per_repeat": [
            {"ttft_p50_overhead_ms": round(gr["ttft_p50_ms"] - dr["ttft_p50_ms"], 1),
             "throughput_overhead_pct": round(100 * (1 - gr["output_tok_s"] / dr["output_tok_s"]), 2)}
            for dr, gr in zip(runs["direct"], runs["gateway"])
        ],  # fmt: skip
        "meets_ttft_target": ttft_over <= TARGET_TTFT_OVERHEAD_MS,
        "meets_throughput_target": tput_over <= TARGET_THROUGHPUT_OVERHEAD_PCT,
    }
    return overhead, micro, peaks


def run_prefix_routing(fleet: Fleet, a: argparse.Namespace) -> tuple[dict, dict]:
    out: dict[str, Any] = {}
    peaks: dict[str, float | None] = {}
    reqs: list[BenchRequest] | None = None
    for policy in ("prefix_affinity", "round_robin"):
        replicas = fleet.start_replicas(policy)  # fresh: an empty prefix cache
        if reqs is None:
            reqs = asyncio.run(make_requests(replicas[0], "shared-prefix", a, a.seed))
        gateway = fleet.start_gateway(policy, replicas, policy)
        warm_up([*replicas, gateway])
        g0 = scrape(gateway)
        run = phase(replicas, [(gateway, reqs, a.sp_concurrency)])
        g1 = scrape(gateway)
        decisions = {d: int(delta(g0, g1, "inferd_gateway:routing_decisions_total", decision=d))
                     for d in ("affinity", "overload", "least_loaded", "round_robin")}  # fmt: skip
        run["routing_decisions"] = {d: n for d, n in decisions.items() if n}
        check(policy, run, a.sp_prompts * a.sp_output_len)
        out[policy] = run
        print(f"{policy:16}: TTFT p50 {run['ttft_p50_ms']:8.1f} ms, p95 {run['ttft_p95_ms']:8.1f} ms, "
              f"hit rates {[x['prefix_cache_hit_rate'] for x in run['replicas']]}, {run['failed']} failed")  # fmt: skip
        peaks.update({**fleet.peak_mb("replica"), **fleet.peak_mb("gateway")})
        out.setdefault("kv_cache_tokens", {}).update(fleet.kv_cache_tokens("replica"))
        fleet.stop("gateway")
        fleet.stop("replica")
    out["affinity_ttft_speedup"] = round(out["round_robin"]["ttft_p50_ms"] / out["prefix_affinity"]["ttft_p50_ms"], 3)
    out["cache_isolation"] = "replicas restarted before each policy's phase: both start from an empty prefix cache"
    out["prompts"] = "the same shared-prefix prompts in both phases"
    return out, peaks


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("overhead (random prompts)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--concurrency", type=int, default=32, help="through the gateway; direct: half per replica")
    g.add_argument("--repeats", type=int, default=2, help="direct/gateway pairs, order alternating")
    g.add_argument("--overhead-policy", default="round_robin", choices=["round_robin", "least_loaded"])
    g.add_argument("--micro-requests", type=int, default=50, help="sequential 1-token requests each way")
    g = ap.add_argument_group("prefix routing (shared-prefix prompts)")
    g.add_argument("--sp-prefixes", type=int, default=16)
    g.add_argument("--sp-prefix-len", type=int, default=1000)
    g.add_argument("--sp-prompts", type=int, default=64, help="requests, spread evenly over the prefixes")
    g.add_argument("--sp-question-len", type=int, default=32)
    g.add_argument("--sp-output-len", type=int, default=32)
    g.add_argument("--sp-concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.concurrency < 2 or a.concurrency % 2:
        ap.error(f"--concurrency must be even and >= 2 (half goes to each replica directly), got {a.concurrency}")
    for name in ("num_prompts", "input_len", "output_len", "repeats", "micro_requests", "sp_prefixes", "sp_prefix_len",
                 "sp_prompts", "sp_question_len", "sp_output_len", "sp_concurrency", "threads"):  # fmt: skip
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def main() -> None:
    a = parse_args()
    # SIGTERM ends the run like Ctrl-C: through the finally that stops the processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="inferd-gateway-bench-") as tmp:
        fleet = Fleet(Path(tmp), a.threads)
        ok = False
        try:
            overhead, micro, peaks = run_overhead(fleet, a)
            prefix, prefix_peaks = run_prefix_routing(fleet, a)
            ok = True
        finally:
            fleet.stop_all(show_logs=not ok)
    result = {
        "benchmark": "gateway_overhead",
        "workload": (
            f"2 replicas of the default model (--threads {a.threads} each); overhead: {a.num_prompts} random prompts x "
            f"{a.input_len} in / {a.output_len} out, concurrency {a.concurrency} via the gateway vs "
            f"{a.concurrency // 2} per replica direct, {a.repeats} repeats; prefix routing: {a.sp_prefixes} prefixes of "
            f"{a.sp_prefix_len} tokens x {a.sp_prompts} questions of {a.sp_question_len}, {a.sp_output_len} out, "
            f"concurrency {a.sp_concurrency}"
        ),
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "targets": {"ttft_p50_overhead_ms": TARGET_TTFT_OVERHEAD_MS, "throughput_overhead_pct": TARGET_THROUGHPUT_OVERHEAD_PCT},
        "ttft_p50_overhead_ms": overhead["ttft_p50_overhead_ms"],
        "throughput_overhead_pct": overhead["throughput_overhead_pct"],
        "proxy_overhead_ms": micro["overhead_ms"],
        "affinity_ttft_speedup": prefix["affinity_ttft_speedup"],
        "overhead": overhead,
        "proxy_overhead": micro,
        "prefix_routing": prefix,
        "peak_rss_mb": {"overhead_phase": peaks, "prefix_routing_phase": prefix_peaks},
        "replica_command": "inferd serve --served-model-name smol --kv-cache-memory-gb 0.5 --max-model-len 2048 "
        f"--threads {a.threads}",
        "command": shlex.join(["python", "benchmarks/gateway_overhead.py", *sys.argv[1:]]),
        "cpu_model": cpu_model(),
        "machine": f"{platform.machine()} nproc={os.cpu_count()}",
        "python": platform.python_version(),
        "wall_s": round(time.time() - started, 1),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print_summary(result)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
