"""A run as JSON (vLLM's benchmark field names where they exist) and as a rich table; a sweep likewise."""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timezone

from rich import box
from rich.console import Console
from rich.table import Table

from inferd.bench.config import BenchConfig
from inferd.bench.metrics import BenchMetrics, Stats
from inferd.bench.records import RequestResult
from inferd.bench.sweep import Step, max_rate_held

LATENCIES = ("ttft", "tpot", "itl", "e2el")
_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)", "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf


def _config(cfg: BenchConfig, model: str) -> dict:
    config = dataclasses.asdict(cfg)
    config["request_rate"] = _finite(cfg.request_rate)
    config["slo"] = cfg.slo.as_dict() if cfg.slo else None
    config["model"] = model
    config.pop("api_key")
    return config


def _header(cfg: BenchConfig, model: str) -> dict:
    return {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "model_id": model,
    }


def to_json(
    m: BenchMetrics, cfg: BenchConfig, model: str, results: list[RequestResult], notes: list[str]
) -> dict:
    out: dict = _header(cfg, model) | {
        "num_prompts": len(results),
        "request_rate": _finite(cfg.request_rate),
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.concurrency,
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "cost_per_million_output_tokens": m.cost_per_million_output_tokens,
        "errors_by_kind": m.errors_by_kind,
    }
    for name in LATENCIES:
        stats: Stats = getattr(m, name)
        for key in ("mean", "median", "std", "p90", "p95", "p99"):
            out[f"{key}_{name}_ms"] = getattr(stats, key)
    # Per request, in send order; times in seconds as vLLM writes them, None where undefined.
    out |= {
        "input_lens": [r.input_tokens for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2el for r in results],
        "start_times": [r.start for r in results],
        "errors": [r.error if not r.ok else "" for r in results],
        "error_kinds": [r.error_kind for r in results],
        "config": _config(cfg, model),
        "notes": notes,
    }
    return out


def _num(x: float | int | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:,.{digits}f}"


def table(m: BenchMetrics, cfg: BenchConfig, model: str) -> Table:
    t = Table(title=f"inferd bench: {model} at {cfg.url} ({cfg.endpoint})", show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("Successful requests", _num(m.completed)),
        ("Failed requests", _num(m.failed)),
    ]
    rows += [(f"  {kind}", _num(n)) for kind, n in m.errors_by_kind.items()]
    rows += [
        ("Benchmark duration (s)", _num(m.duration)),
        ("Total input tokens", _num(m.total_input_tokens)),
        ("Total generated tokens", _num(m.total_output_tokens)),
        ("Request throughput (req/s)", _num(m.request_throughput)),
        ("Output token throughput (tok/s)", _num(m.output_throughput)),
        ("Total token throughput (tok/s)", _num(m.total_token_throughput)),
    ]
    if m.request_goodput is not None:
        rows.append((f"Request goodput (req/s), {m.good_requests} met the SLO", _num(m.request_goodput)))
    if cfg.cost_per_hour is not None:
        rows.append(("Cost per 1M output tokens (USD)", _num(m.cost_per_million_output_tokens, 4)))
    for label, value in rows:
        t.add_row(label, value)
    for name in LATENCIES:
        stats: Stats = getattr(m, name)
        t.add_section()
        t.add_row(f"[bold]{_NAMES[name]} (ms)[/bold]", "")
        for key, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p95", "P95"), ("p99", "P99")):
            t.add_row(f"  {label}", _num(getattr(stats, key)))
    return t


def print_report(console: Console, m: BenchMetrics, cfg: BenchConfig, model: str, notes: list[str]) -> None:
    console.print(table(m, cfg, model))
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def sweep_to_json(steps: list[Step], cfg: BenchConfig, model: str, notes: list[str]) -> dict:
    """Each step as a single run writes it (per-request arrays included, so a
    step can be re-analysed), less the config and notes, which are the sweep's."""
    assert cfg.slo is not None  # BenchConfig refuses a sweep without one
    return _header(cfg, model) | {
        "sweep": [
            {k: v for k, v in s.result.items() if k not in ("config", "notes")} | {"held": s.held} for s in steps
        ],
        "max_rate_held": max_rate_held(steps),
        "slo": cfg.slo.as_dict(),
        "slo_attainment": cfg.slo_attainment,
        "sweep_rates": cfg.rates(),
        "num_prompts": cfg.num_prompts,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.concurrency,
        "config": _config(cfg, model),
        "notes": notes,
    }


def _rate(x: float) -> str:
    return f"{x:g}"


def _met(m: BenchMetrics) -> str:
    met = f"{m.good_requests or 0}/{m.completed + m.failed}"
    return f"{met}, {m.failed} failed" if m.failed else met


def sweep_table(steps: list[Step], cfg: BenchConfig, model: str) -> Table:
    """One row per step; two-line headers and no vertical rules so it fits 80 columns."""
    slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in cfg.slo.as_dict().items()) if cfg.slo else "-"
    t = Table(
        title=f"inferd bench --sweep: {model} at {cfg.url} ({cfg.endpoint})",
        caption=f"SLO {slo}; a rate holds when >= {cfg.slo_attainment:.0%} meet it and none fails. Rates in req/s, latencies in ms",
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for header in (
        "rate", "achieved\nrate", "TTFT\np50", "TTFT\np99", "TPOT\np50", "TPOT\np99", "E2EL\np99",
        "goodput", "met\nSLO", "held",
    ):  # fmt: skip
        t.add_column(header, justify="right")
    for s in steps:
        m = s.metrics
        t.add_row(
            _rate(s.rate), _num(m.request_throughput), _num(m.ttft.median, 1), _num(m.ttft.p99, 1), _num(m.tpot.median, 1),
            _num(m.tpot.p99, 1), _num(m.e2el.p99, 1), _num(m.request_goodput), _met(m), "[green]yes[/green]" if s.held else "[red]no[/red]",
        )  # fmt: skip
    return t


def held_line(steps: list[Step], cfg: BenchConfig) -> str:
    best = max_rate_held(steps)
    if best is None:
        return f"highest rate that held: none (the first, {_rate(steps[0].rate)} req/s, did not)" if steps else "highest rate that held: none"
    line = f"highest rate that held: {_rate(best)} req/s"
    if all(s.held for s in steps) and len(steps) == len(cfg.rates()):
        line += " (every rate held: the limit is higher than the sweep went)"
    return line


def print_sweep_report(console: Console, steps: list[Step], cfg: BenchConfig, model: str, notes: list[str]) -> None:
    console.print(sweep_table(steps, cfg, model))
    console.print(f"[bold]{held_line(steps, cfg)}[/bold]")
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
