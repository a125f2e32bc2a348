"""From request results to the numbers of a run. Pure computation: no I/O, no clock."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from inferd.bench.config import SLO
from inferd.bench.records import RequestResult

PERCENTILES = (50, 90, 95, 99)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of one latency in ms; every field None when there were no values."""

    mean: float | None = None
    std: float | None = None
    median: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of_seconds(cls, values: list[float]) -> Stats:
        if not values:
            return cls()
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))  # population, as numpy's std
        median, p90, p95, p99 = (percentile(ms, p) for p in PERCENTILES)
        return cls(mean=mean, std=std, median=median, p90=p90, p95=p95, p99=p99)


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    errors_by_kind: dict[str, int]
    duration: float  # s
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    request_goodput: float | None  # requests/s meeting the SLO; None without one
    good_requests: int | None
    cost_per_million_output_tokens: float | None  # USD; None without a price or output
    ttft: Stats = field(default_factory=Stats)
    tpot: Stats = field(default_factory=Stats)
    itl: Stats = field(default_factory=Stats)
    e2el: Stats = field(default_factory=Stats)


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    """A completed request meets the SLO when it meets every objective given. An
    undefined TPOT (<= 1 output token) meets any TPOT objective, as in vLLM."""
    if not r.ok:
        return False
    checks = ((slo.ttft_ms, r.ttft), (slo.tpot_ms, r.tpot), (slo.e2el_ms, r.e2el))
    return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def cost_per_million(cost_per_hour: float | None, duration: float, output_tokens: int) -> float | None:
    """USD per 1M output tokens for a machine billed ``cost_per_hour``."""
    if cost_per_hour is None or output_tokens == 0:
        return None
    return cost_per_hour / 3600.0 * duration / output_tokens * 1e6


def summarize(
    results: list[RequestResult], duration: float, slo: SLO | None = None, cost_per_hour: float | None = None
) -> BenchMetrics:
    """``duration``: seconds from the first send to the last result."""
    done = [r for r in results if r.ok]
    errors = Counter(r.error_kind or "unknown" for r in results if not r.ok)
    inputs = sum(r.input_tokens or 0 for r in done)
    outputs = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else 0.0
    good = sum(meets_slo(r, slo) for r in done) if slo is not None else None
    return BenchMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        errors_by_kind=dict(sorted(errors.items())),
        duration=duration,
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=len(done) * per_s,
        output_throughput=outputs * per_s,
        total_token_throughput=(inputs + outputs) * per_s,
        request_goodput=good * per_s if good is not None else None,
        good_requests=good,
        cost_per_million_output_tokens=cost_per_million(cost_per_hour, duration, outputs),
        ttft=Stats.of_seconds([r.ttft for r in done if r.ttft is not None]),
        tpot=Stats.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of_seconds([gap for r in done for gap in r.itl]),
        e2el=Stats.of_seconds([r.e2el for r in done if r.e2el is not None]),
    )
