"""``run(cfg)``: model -> prompts -> load -> metrics -> report; with --sweep, load -> metrics per rate."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inferd.bench.client import Api, BenchError, count_tokens, first_model, send
from inferd.bench.config import BenchConfig
from inferd.bench.datasets import jsonl_requests, local_counter, random_requests, shared_prefix_requests
from inferd.bench.load import arrival_offsets, run_load
from inferd.bench.metrics import BenchMetrics, summarize
from inferd.bench.plot import plot_run, plot_sweep, require_matplotlib
from inferd.bench.records import BenchRequest, RequestResult
from inferd.bench.report import print_report, print_sweep_report, sweep_to_json, to_json
from inferd.bench.sweep import Step, sweep


def _client(cfg: BenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    # The read timeout is per read: a request fails when no byte comes for that long.
    # No pool timeout: a request waiting for a connection is load, not an error.
    timeout = httpx.Timeout(cfg.timeout, pool=None)
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)


async def _requests(cfg: BenchConfig, client: httpx.AsyncClient, model: str, notes: list[str]) -> list[BenchRequest]:
    if cfg.dataset == "jsonl":
        if cfg.dataset_path is None:  # BenchConfig already refuses this
            raise BenchError("--dataset jsonl needs --dataset-path")
        requests = jsonl_requests(cfg.dataset_path, cfg.num_prompts, cfg.output_len, chat=cfg.endpoint == "chat")
        if len(requests) < cfg.num_prompts:
            notes.append(f"{cfg.dataset_path} has {len(requests)} requests, fewer than --num-prompts {cfg.num_prompts}")
        return requests
    if cfg.tokenizer is not None:
        count = local_counter(cfg.tokenizer)
    else:
        count = partial(count_tokens, client, cfg.url, model)
    if cfg.dataset == "shared-prefix":
        requests, exact = await shared_prefix_requests(
            cfg.num_prompts, cfg.num_prefixes, cfg.prefix_len, cfg.input_len, cfg.output_len, cfg.seed, count,
            chat=cfg.endpoint == "chat",
        )  # fmt: skip
    else:
        requests, exact = await random_requests(
            cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.seed, count
        )
    if not exact:
        notes.append("the server has no POST /tokenize: prompt lengths are word counts, an approximation of tokens")
    return requests


def _notes_from(results: list[RequestResult]) -> list[str]:
    notes = []
    if any(r.ok and not r.usage_reported for r in results):
        notes.append("the server sent no usage chunk for some requests: their output tokens are text chunks counted")
    return notes


async def _load(
    cfg: BenchConfig, client: httpx.AsyncClient, api: Api, requests: list[BenchRequest], console: Console, label: str
) -> tuple[list[RequestResult], float]:
    """Send the requests at cfg's rate under a progress bar; (results, seconds)."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[failed]} failed"), console=console, transient=True,
    ) as progress:
        task = progress.add_task("requests", total=len(requests), failed=0)
        failed = 0

        def on_result(r: RequestResult) -> None:
            nonlocal failed
            failed += not r.ok
            progress.update(task, advance=1, failed=failed)

        t0 = time.perf_counter()
        results = await run_load(requests, lambda req: send(client, api, req, t0), offsets, cfg.concurrency, cfg.duration, on_result)
        return results, time.perf_counter() - t0


async def bench(cfg: BenchConfig, console: Console) -> tuple[BenchMetrics, dict, list[RequestResult]]:
    notes: list[str] = []
    async with _client(cfg) as client:
        model = cfg.model or await first_model(client, cfg.url)
        requests = await _requests(cfg, client, model, notes)
        results, duration = await _load(cfg, client, Api(cfg.url, cfg.endpoint, model), requests, console, "bench")
    notes += _notes_from(results)
    metrics = summarize(results, duration, cfg.slo, cfg.cost_per_hour)
    print_report(console, metrics, cfg, model, notes)
    return metrics, to_json(metrics, cfg, model, results, notes), results


async def bench_sweep(cfg: BenchConfig, console: Console) -> tuple[list[Step], dict]:
    """One client, one set of prompts; a run per rate (see inferd.bench.sweep)."""
    notes: list[str] = []
    async with _client(cfg) as client:
        model = cfg.model or await first_model(client, cfg.url)
        requests = await _requests(cfg, client, model, notes)
        api = Api(cfg.url, cfg.endpoint, model)

        async def measure(rate: float) -> tuple[BenchMetrics, dict]:
            step_cfg = dataclasses.replace(cfg, request_rate=rate, sweep=False, sweep_rates=None)
            results, duration = await _load(step_cfg, client, api, requests, console, f"sweep {rate:g} req/s")
            for note in _notes_from(results):
                if note not in notes:
                    notes.append(note)
            metrics = summarize(results, duration, cfg.slo, cfg.cost_per_hour)
            return metrics, to_json(metrics, step_cfg, model, results, [])

        def on_step(step: Step) -> None:
            m = step.metrics
            verdict = "[green]held[/green]" if step.held else "[red]did not hold[/red]"
            console.print(
                f"{step.rate:g} req/s: achieved {m.request_throughput:.2f} req/s, "
                f"{m.good_requests or 0}/{m.completed + m.failed} met the SLO, {m.failed} failed: {verdict}"
            )

        steps = await sweep(cfg.rates(), measure, cfg.slo_attainment, on_step)
    print_sweep_report(console, steps, cfg, model, notes)
    return steps, sweep_to_json(steps, cfg, model, notes)


def run(cfg: BenchConfig, console: Console | None = None) -> int:
    """Run the benchmark (or the sweep) and print its report; 0 when at least
    one request completed (in a sweep: in its first step, whether or not any
    rate held), 1 when none did or the run could not start. ValueError, before
    any request, when --plot is given without matplotlib."""
    console = console or Console()
    if cfg.plot:
        require_matplotlib()
    try:
        if cfg.sweep:
            steps, result = asyncio.run(bench_sweep(cfg, console))
            completed = steps[0].metrics.completed if steps else 0
        else:
            metrics, result, results = asyncio.run(bench(cfg, console))
            completed = metrics.completed
    except BenchError as e:
        print(f"inferd bench: error: {e}", file=sys.stderr)
        return 1
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {cfg.output}")
    if cfg.plot:  # after the JSON: a plot that fails to save loses no measurement
        model = result["model_id"]
        if cfg.sweep:
            plot_sweep(cfg.plot, steps, cfg.slo, f"inferd bench --sweep: {model}, {cfg.num_prompts} requests per rate")
        else:
            plot_run(cfg.plot, results, cfg.slo, f"inferd bench: {model}, {len(results)} requests")
        console.print(f"wrote {cfg.plot}")
    return 0 if completed else 1
