"""``--plot FILE.png``: latency charts of a run or a sweep.

matplotlib is an optional extra (``pip install 'inferd[bench]'``), imported
only here and only when a plot is asked for, so a bench without ``--plot``
never pays for it. Figures go straight to the Agg canvas, never through
pyplot: no display, no global figure state, nothing to close.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from inferd.bench.config import SLO
from inferd.bench.records import RequestResult
from inferd.bench.sweep import Step, max_rate_held

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL = "pip install 'inferd[bench]' (or matplotlib>=3.8)"
_PERCENTILES = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))


def require_matplotlib() -> None:
    """Fail before the benchmark, not after minutes of it, when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"plot: --plot needs matplotlib, which is not installed: {INSTALL}") from None


def _figure(ncols: int) -> tuple[Figure, list[Axes]]:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * ncols, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols))


def _slo_line(ax: Axes, limit: float | None, label: str, vertical: bool = False) -> None:
    if limit is None:
        return
    line = ax.axvline if vertical else ax.axhline
    line(limit, color="tab:red", linewidth=1.2, linestyle="-.", label=f"{label} SLO {limit:g} ms")


def plot_run(path: str, results: Sequence[RequestResult], slo: SLO | None, title: str) -> None:
    """Histograms of TTFT and inter-token latency (ms) of the completed requests."""
    fig, (ttft_ax, itl_ax) = _figure(2)
    done = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in done if r.ttft is not None]
    itls = [gap * 1000 for r in done for gap in r.itl]
    for ax, values, name, limit in (
        (ttft_ax, ttfts, "Time to first token", slo.ttft_ms if slo else None),
        (itl_ax, itls, "Inter-token latency", slo.tpot_ms if slo else None),
    ):
        if values:
            ax.hist(values, bins=min(50, max(10, len(values) // 4)), color="tab:blue", alpha=0.8)
        else:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
        _slo_line(ax, limit, "TPOT" if name.startswith("Inter") else "TTFT", vertical=True)
        ax.set(title=f"{name} ({len(values)} values)", xlabel="ms", ylabel="count")
        if limit is not None:
            ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def plot_sweep(path: str, steps: Sequence[Step], slo: SLO | None, title: str) -> None:
    """TTFT (with the E2EL P99) and TPOT percentiles against the achieved request rate, SLO lines drawn."""
    fig, (ttft_ax, tpot_ax) = _figure(2)
    measured = [s for s in steps if s.metrics.completed and s.metrics.request_throughput > 0]
    rates = [s.metrics.request_throughput for s in measured]
    for ax, name, label in ((ttft_ax, "ttft", "TTFT"), (tpot_ax, "tpot", "TPOT")):
        for key, tag, style in _PERCENTILES:
            _series(ax, rates, [getattr(getattr(s.metrics, name), key) for s in measured], f"{label} {tag}", style)
    _series(ttft_ax, rates, [s.metrics.e2el.p99 for s in measured], "E2EL p99", "-", color="tab:gray")
    if slo is not None:
        _slo_line(ttft_ax, slo.ttft_ms, "TTFT")
        _slo_line(ttft_ax, slo.e2el_ms, "E2EL")
        _slo_line(tpot_ax, slo.tpot_ms, "TPOT")
    best = max_rate_held(steps)
    for ax, name in ((ttft_ax, "Time to first token / end-to-end"), (tpot_ax, "Time per output token")):
        for s in measured:
            if not s.held:  # the step that broke the SLO
                ax.axvline(s.metrics.request_throughput, color="tab:red", alpha=0.25, linewidth=6)
        if len(rates) > 1 and max(rates) / min(rates) >= 8:
            ax.set_xscale("log", base=2)
        ax.set(title=name, xlabel="achieved request rate (req/s)", ylabel="ms")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    held = f"highest rate that held: {best:g} req/s" if best is not None else "no rate held"
    fig.suptitle(f"{title}\n{held}")
    fig.savefig(path, dpi=110)


def _series(ax: Axes, xs: list[float], ys: list[float | None], label: str, style: str, color: str | None = None) -> None:
    points = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if points:
        ax.plot(*zip(*points), style, marker="o", label=label, color=color)
