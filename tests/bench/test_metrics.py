"""inferd.bench.metrics on hand-made results, with hand-computed numbers."""

from __future__ import annotations

import pytest

from inferd.bench.config import SLO
from inferd.bench.metrics import Stats, cost_per_million, meets_slo, percentile, summarize
from inferd.bench.records import RequestResult


def ok(ttft: float, e2el: float, out: int, inp: int = 10, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(ok=True, ttft=ttft, e2el=e2el, output_tokens=out, input_tokens=inp, itl=itl or [])


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5  # rank 1.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_stats_are_in_ms():
    s = Stats.of_seconds([0.1, 0.2, 0.3])
    assert s.mean == pytest.approx(200.0) and s.median == pytest.approx(200.0)
    assert s.p90 == pytest.approx(280.0)  # rank 1.8 over 100 200 300
    assert s.p99 == pytest.approx(298.0)
    assert s.std == pytest.approx((20000 / 3) ** 0.5)
    assert Stats.of_seconds([]) == Stats()


def test_tpot_excludes_the_first_token_and_is_undefined_for_one():
    assert ok(ttft=0.5, e2el=1.5, out=5).tpot == pytest.approx(0.25)  # 1.0 s over 4 tokens
    assert ok(ttft=0.5, e2el=0.5, out=1).tpot is None
    assert RequestResult(ok=False, ttft=0.5, e2el=1.5, output_tokens=5).tpot is None


def test_summarize_counts_only_completed_requests():
    results = [
        ok(ttft=0.1, e2el=0.5, out=5, inp=10, itl=[0.1, 0.1, 0.1, 0.1]),  # tpot 0.1
        ok(ttft=0.3, e2el=1.1, out=3, inp=20, itl=[0.4, 0.4]),  # tpot 0.4
        RequestResult().fail("http_500", "boom"),
        RequestResult().fail("timeout"),
        RequestResult().fail("timeout"),
    ]
    m = summarize(results, duration=2.0)
    assert (m.completed, m.failed) == (2, 3)
    assert m.errors_by_kind == {"http_500": 1, "timeout": 2}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 8)
    assert m.request_throughput == 1.0
    assert m.output_throughput == 4.0
    assert m.total_token_throughput == 19.0
    assert m.ttft.mean == pytest.approx(200.0) and m.ttft.median == pytest.approx(200.0)
    assert m.tpot.mean == pytest.approx(250.0) and m.tpot.p99 == pytest.approx(397.0)
    assert m.itl.mean == pytest.approx(200.0) and m.itl.median == pytest.approx(100.0)  # 4x0.1, 2x0.4
    assert m.e2el.mean == pytest.approx(800.0)
    assert m.request_goodput is None and m.good_requests is None
    assert m.cost_per_million_output_tokens is None


def test_goodput_counts_requests_meeting_every_objective():
    results = [
        ok(ttft=0.1, e2el=0.5, out=5),  # tpot 100 ms
        ok(ttft=0.3, e2el=1.1, out=3),  # tpot 400 ms
        ok(ttft=0.1, e2el=0.1, out=1),  # tpot undefined: meets any tpot objective
        RequestResult().fail("connection"),
    ]
    assert summarize(results, 2.0, SLO(ttft_ms=200)).good_requests == 2
    assert summarize(results, 2.0, SLO(ttft_ms=200, tpot_ms=150)).request_goodput == 1.0  # 2 over 2 s
    assert summarize(results, 2.0, SLO(e2el_ms=1000)).good_requests == 2
    assert summarize(results, 2.0, SLO(ttft_ms=50)).request_goodput == 0.0
    assert not meets_slo(RequestResult().fail("timeout"), SLO(ttft_ms=1e9))
    assert meets_slo(ok(ttft=0.2, e2el=0.2, out=1), SLO(ttft_ms=200))  # the bound itself holds


def test_cost_per_million_output_tokens():
    # $3.60/h for 100 s is $0.10, for 50,000 tokens: $2 per 1M.
    assert cost_per_million(3.6, 100.0, 50_000) == pytest.approx(2.0)
    assert cost_per_million(3.6, 100.0, 0) is None
    assert cost_per_million(None, 100.0, 10) is None
    m = summarize([ok(ttft=0.1, e2el=0.5, out=1000)], duration=10.0, cost_per_hour=36.0)
    assert m.cost_per_million_output_tokens == pytest.approx(100.0)  # $0.10 / 1000 tokens


def test_no_results_gives_zeros_not_errors():
    m = summarize([], duration=0.0)
    assert (m.completed, m.failed, m.request_throughput) == (0, 0, 0.0)
    assert m.ttft == Stats()
