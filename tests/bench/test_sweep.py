"""--sweep's stepping, flags, report and plots, on made-up results: no server."""

from __future__ import annotations

import asyncio
import io
import json
import sys

import pytest
from rich.console import Console

from inferd.bench.config import SLO, BenchConfig
from inferd.bench.metrics import BenchMetrics, Stats
from inferd.bench.records import RequestResult
from inferd.bench.report import held_line, sweep_table, sweep_to_json
from inferd.bench.sweep import Step, holds, max_rate_held, sweep
from inferd.cli import main, parse_config

PNG = b"\x89PNG\r\n\x1a\n"
URL = "http://127.0.0.1:1"


def metrics(completed: int, failed: int = 0, good: int | None = None, rate: float = 1.0) -> BenchMetrics:
    """A step's metrics: ``good`` of ``completed`` met the SLO (all, by default)."""
    good = completed if good is None else good
    latency = Stats(mean=10.0, std=1.0, median=10.0 * rate, p90=12.0 * rate, p95=13.0 * rate, p99=15.0 * rate)
    return BenchMetrics(
        completed=completed, failed=failed, errors_by_kind={"timeout": failed} if failed else {}, duration=1.0,
        total_input_tokens=0, total_output_tokens=0, request_throughput=rate * 0.95, output_throughput=0.0,
        total_token_throughput=0.0, request_goodput=good * rate * 0.95 / max(completed, 1), good_requests=good,
        cost_per_million_output_tokens=None, ttft=latency, tpot=latency, itl=latency, e2el=latency,
    )  # fmt: skip


def run_sweep(by_rate: dict[float, BenchMetrics], attainment: float = 0.9) -> tuple[list[Step], list[float]]:
    asked: list[float] = []

    async def measure(rate: float) -> tuple[BenchMetrics, dict]:
        asked.append(rate)
        return by_rate[rate], {"request_rate": rate}

    return asyncio.run(sweep(list(by_rate), measure, attainment)), asked


@pytest.mark.parametrize(
    ("m", "attainment", "held"),
    [
        (metrics(10), 0.9, True),
        (metrics(10, good=9), 0.9, True),  # exactly the attainment
        (metrics(10, good=8), 0.9, False),
        (metrics(10, good=7), 0.7, True),  # 7 >= 0.7 * 10 is False in floats; the ratio is not
        (metrics(10, good=9, failed=1), 0.5, False),  # any failure breaks the step
        (metrics(0, failed=3, good=0), 0.9, False),
        (metrics(0, good=0), 0.9, False),  # nothing completed (e.g. --duration too short)
        (metrics(10, good=10), 1.0, True),
    ],
)
def test_which_step_holds(m, attainment, held):
    assert holds(m, attainment) is held


def test_a_step_without_an_slo_never_holds():
    m = metrics(4)
    assert not holds(BenchMetrics(**{**vars(m), "good_requests": None, "request_goodput": None}), 0.5)


def test_the_sweep_stops_at_the_first_step_that_does_not_hold():
    steps, asked = run_sweep({1.0: metrics(10), 2.0: metrics(10, good=9), 4.0: metrics(10, good=5), 8.0: metrics(10)})
    assert asked == [1.0, 2.0, 4.0]  # 8 is never run
    assert [s.held for s in steps] == [True, True, False]
    assert [s.result for s in steps] == [{"request_rate": r} for r in asked]
    assert max_rate_held(steps) == 2.0


def test_a_sweep_that_always_holds_runs_every_rate():
    steps, asked = run_sweep({0.5: metrics(4), 1.0: metrics(4), 2.0: metrics(4)})
    assert asked == [0.5, 1.0, 2.0] and max_rate_held(steps) == 2.0


def test_a_sweep_whose_first_step_fails_holds_no_rate():
    steps, asked = run_sweep({1.0: metrics(4, good=0), 2.0: metrics(4)})
    assert asked == [1.0] and max_rate_held(steps) is None
    assert max_rate_held([]) is None


def test_sweep_flags_flow_into_the_config():
    cfg = parse_config([
        "bench", URL, "--sweep", "--slo", "ttft=500", "--sweep-rates", "0.5,1,3", "--slo-attainment", "0.95",
        "--plot", "p.png",
    ])  # fmt: skip
    assert (cfg.sweep, cfg.sweep_rates, cfg.slo_attainment, cfg.plot) == (True, (0.5, 1.0, 3.0), 0.95, "p.png")
    assert cfg.rates() == [0.5, 1.0, 3.0]
    cfg = parse_config(["bench", URL, "--sweep", "--slo", "ttft=500", "--sweep-start", "1", "--sweep-max", "10"])
    assert cfg.rates() == [1.0, 2.0, 4.0, 8.0]  # doubling, stopping at or below the max


def test_the_default_series_doubles_from_half_a_request_to_64():
    cfg = parse_config(["bench", URL, "--sweep", "--slo", "e2el=2000"])
    assert (cfg.sweep_start, cfg.sweep_max, cfg.slo_attainment) == (0.5, 64.0, 0.9)
    assert cfg.rates() == [0.5, 1, 2, 4, 8, 16, 32, 64]
    assert BenchConfig(url=URL, sweep=True, slo=SLO(ttft_ms=1), sweep_start=0.1, sweep_max=0.8).rates()[-1] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--sweep"], "slo is required"),
        (["--sweep", "--slo", "ttft=5", "--request-rate", "4"], "request_rate"),
        (["--sweep", "--slo", "ttft=5", "--sweep-rates", "2,1"], "sweep_rates must rise"),
        (["--sweep", "--slo", "ttft=5", "--sweep-rates", "0,1"], "sweep_rates"),
        (["--sweep", "--slo", "ttft=5", "--sweep-rates", "1,inf"], "sweep_rates"),
        (["--sweep-rates", "1,2"], "sweep_rates is only for --sweep"),
        (["--sweep", "--slo", "ttft=5", "--sweep-start", "0"], "sweep_start"),
        (["--sweep", "--slo", "ttft=5", "--sweep-start", "4", "--sweep-max", "2"], "sweep_max"),
        (["--slo-attainment", "0"], "slo_attainment"),
        (["--slo-attainment", "1.5"], "slo_attainment"),
        (["--plot", "p.jpg"], "plot must end in"),
    ],
)
def test_bad_sweep_values_name_the_field(flags, field):
    with pytest.raises(ValueError, match=field):
        parse_config(["bench", URL, *flags])


def test_bad_sweep_rates_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["bench", URL, "--sweep", "--sweep-rates", "1,fast"])
    assert exc.value.code == 2 and "separated by commas" in capsys.readouterr().err


def _steps() -> list[Step]:
    return [
        Step(rate=r, metrics=metrics(10, good=g, rate=r), held=g >= 9, result={"request_rate": r, "config": {}, "notes": []})
        for r, g in ((1.0, 10), (2.0, 9), (4.0, 3))
    ]


def _cfg(**kw) -> BenchConfig:
    return BenchConfig(**{"url": URL, "sweep": True, "slo": SLO(ttft_ms=50, tpot_ms=20), "sweep_rates": (1.0, 2.0, 4.0, 8.0), **kw})


def test_the_sweep_report_has_a_row_per_step_and_the_highest_rate():
    console = Console(file=io.StringIO(), width=220)
    console.print(sweep_table(_steps(), _cfg(), "m"))
    text = console.file.getvalue()
    assert text.count("yes") == 2 and text.count(" no ") == 1 and "9/10" in text and "3/10" in text
    assert held_line(_steps(), _cfg()) == "highest rate that held: 2 req/s"
    assert held_line(_steps()[2:], _cfg()) == "highest rate that held: none (the first, 4 req/s, did not)"
    every = _cfg(sweep_rates=(1.0, 2.0))
    assert "every rate held" in held_line(_steps()[:2], every)


def test_the_sweep_json_keeps_each_steps_result_and_the_verdict():
    r = json.loads(json.dumps(sweep_to_json(_steps(), _cfg(), "m", ["a note"])))
    assert r["max_rate_held"] == 2.0 and r["slo"] == {"ttft_ms": 50, "tpot_ms": 20} and r["slo_attainment"] == 0.9
    assert r["sweep_rates"] == [1.0, 2.0, 4.0, 8.0] and r["model_id"] == "m" and r["notes"] == ["a note"]
    assert [s["held"] for s in r["sweep"]] == [True, True, False]
    assert [s["request_rate"] for s in r["sweep"]] == [1.0, 2.0, 4.0]
    assert all("config" not in s and "notes" not in s for s in r["sweep"])
    assert r["config"]["sweep"] is True and r["config"]["request_rate"] == "inf"


def test_plots_of_a_sweep_and_a_run_are_pngs(tmp_path):
    from inferd.bench.plot import plot_run, plot_sweep

    plot_sweep(str(tmp_path / "s.png"), _steps(), SLO(ttft_ms=50, tpot_ms=20, e2el_ms=80), "sweep")
    plot_sweep(str(tmp_path / "none.png"), [], None, "nothing measured")
    results = [RequestResult(ok=True, ttft=0.01 * i, itl=[0.002, 0.003], e2el=0.1, output_tokens=3) for i in range(1, 9)]
    plot_run(str(tmp_path / "r.png"), [*results, RequestResult().fail("timeout")], SLO(ttft_ms=50), "run")
    plot_run(str(tmp_path / "empty.svg"), [], None, "no results")
    for name in ("s.png", "none.png", "r.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert b"<svg" in (tmp_path / "empty.svg").read_bytes()


def test_plot_without_matplotlib_fails_before_any_request(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    from inferd.bench.plot import require_matplotlib

    with pytest.raises(ValueError, match="plot: --plot needs matplotlib"):
        require_matplotlib()
    # URL is a closed port: a request would fail as `connection`, exit 1; the check comes first.
    assert main(["bench", URL, "--plot", str(tmp_path / "p.png"), "--num-prompts", "1"]) == 2
    assert "pip install 'inferd[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_matplotlib_is_imported_only_for_a_plot():
    import subprocess

    code = "import sys, inferd.cli, inferd.bench.main; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
