"""When requests are sent: an arrival schedule, a concurrency limit, a duration cap."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable

from inferd.bench.records import BenchRequest, RequestResult


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed
    gaps of shape ``burstiness`` and mean ``1/rate`` (shape 1 is a Poisson process).
    An infinite rate sends everything at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


async def run_load(
    requests: list[BenchRequest],
    send: Callable[[BenchRequest], Awaitable[RequestResult]],
    offsets: list[float],
    concurrency: int | None = None,
    duration: float | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send each request at its offset, at most ``concurrency`` in flight (a
    request that arrives while all slots are busy waits for one). No request
    starts after ``duration`` seconds; those in flight finish. Results come in
    request order, without the requests that never started."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    def expired() -> bool:
        return duration is not None and time.perf_counter() - t0 >= duration

    async def one(req: BenchRequest) -> RequestResult | None:
        if limit is None:
            result = await send(req)
        else:
            async with limit:
                if expired():
                    return None
                result = await send(req)
        if on_result is not None:
            on_result(result)
        return result

    tasks: list[asyncio.Task] = []
    try:
        for req, offset in zip(requests, offsets):
            delay = offset - (time.perf_counter() - t0)
            if duration is not None and offset >= duration:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if expired():
                break
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return [r for r in results if r is not None]
