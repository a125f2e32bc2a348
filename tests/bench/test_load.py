"""inferd.bench.load: the arrival schedule and the limits on a run."""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest

from inferd.bench.load import arrival_offsets, run_load
from inferd.bench.records import BenchRequest, RequestResult


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(4, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0, 0.0]


def test_gaps_have_mean_one_over_rate_and_are_seeded():
    offsets = arrival_offsets(20_001, 50.0, 1.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: std = mean
    assert offsets == arrival_offsets(20_001, 50.0, 1.0, seed=1)
    assert offsets != arrival_offsets(20_001, 50.0, 1.0, seed=2)


def test_burstiness_changes_the_spread_not_the_mean():
    # Gamma of shape B and scale 1/(R*B): mean 1/R, std 1/(R*sqrt(B)).
    offsets = arrival_offsets(20_001, 10.0, 4.0, seed=0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.05, rel=0.05)


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(prompt=str(i), messages=None, max_tokens=1) for i in range(n)]


def test_concurrency_bounds_the_requests_in_flight():
    in_flight = peak = 0

    async def send(req: BenchRequest) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(ok=True, error=req.prompt or "")

    seen: list[RequestResult] = []
    results = asyncio.run(run_load(_requests(12), send, [0.0] * 12, concurrency=3, on_result=seen.append))
    assert peak == 3
    assert [r.error for r in results] == [str(i) for i in range(12)]  # request order
    assert len(seen) == 12


def test_no_request_starts_after_the_duration():
    async def send(req: BenchRequest) -> RequestResult:
        await asyncio.sleep(0.1)
        return RequestResult(ok=True)

    # One slot, 0.1 s each, a 0.25 s cap: requests 0, 1 and 2 start, the rest never do.
    t = time.monotonic()
    results = asyncio.run(run_load(_requests(50), send, [0.0] * 50, concurrency=1, duration=0.25))
    assert len(results) == 3
    assert time.monotonic() - t < 1.0
    # By arrival time: offsets past the cap are never sent.
    results = asyncio.run(run_load(_requests(5), send, [0.0, 0.05, 0.1, 10.0, 20.0], duration=0.5))
    assert len(results) == 3
