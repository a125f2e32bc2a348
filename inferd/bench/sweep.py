"""``--sweep``: raise the request rate step by step until the SLO fails.

Design. A sweep needs ``--slo``: it is what decides whether a rate held. The
rates are ``--sweep-rates`` as given (rising), else ``--sweep-start`` (0.5
req/s) doubling while it stays <= ``--sweep-max`` (64): a geometric series
finds the knee in a few steps whatever the server's scale. Each step is the
normal benchmark at that rate: the same prompts (same dataset and seed),
``--num-prompts`` of them, the same burstiness, concurrency cap and duration.

A step *holds* when no request failed and at least ``--slo-attainment`` (0.9)
of its requests met every objective of the SLO, i.e. goodput /
request_throughput >= attainment. A failed request is never "within the SLO",
and dropping it from the ratio would let an overloaded server pass by
refusing work, so any failure breaks the step. The sweep stops at the first
step that does not hold: the steps before it all held, and a higher rate is
not expected to do better. ``max_rate_held`` is the target rate of the last
step that held, None when the first did not.

The stepping here is pure: ``sweep`` gets a ``measure(rate)`` coroutine, so
its logic is tested with made-up results and no server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from inferd.bench.metrics import BenchMetrics


@dataclass
class Step:
    rate: float  # the target requests/s
    metrics: BenchMetrics
    held: bool
    result: dict = field(default_factory=dict)  # the step's JSON, as a single run writes it


def holds(m: BenchMetrics, attainment: float) -> bool:
    """No request failed and ``attainment`` of the completed met the SLO.
    A step with no SLO (good_requests None) or nothing completed never holds."""
    if m.failed or m.completed == 0 or m.good_requests is None:
        return False
    return m.good_requests / m.completed >= attainment  # a ratio, not good >= 0.7 * n: 0.7 * 10 > 7


async def sweep(
    rates: Sequence[float],
    measure: Callable[[float], Awaitable[tuple[BenchMetrics, dict]]],
    attainment: float,
    on_step: Callable[[Step], None] | None = None,
) -> list[Step]:
    """Measure each rate in order until one does not hold; that one is the last step."""
    steps: list[Step] = []
    for rate in rates:
        metrics, result = await measure(rate)
        step = Step(rate=rate, metrics=metrics, held=holds(metrics, attainment), result=result)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        if not step.held:
            break
    return steps


def max_rate_held(steps: Sequence[Step]) -> float | None:
    """The highest target rate that held; None when none did."""
    return max((s.rate for s in steps if s.held), default=None)
