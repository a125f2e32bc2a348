"""``BenchConfig`` and the ``inferd bench`` flags that fill it (argparse only: cheap to import)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from dataclasses import dataclass, field

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DATASETS = ("random", "shared-prefix", "jsonl")
PLOT_FORMATS = (".png", ".svg", ".pdf")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in ms; a request meets the SLO when it meets every one given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=500,tpot=50,e2el=2000`` (any subset) -> SLO."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"slo: expected ttft=MS, tpot=MS or e2el=MS, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"slo: {name} must be a number of ms, got {value!r}") from None
            if not ms > 0:
                raise ValueError(f"slo: {name} must be > 0 ms, got {value}")
            values[f"{name}_ms"] = ms
        if not values:
            raise ValueError("slo: give at least one of ttft=MS, tpot=MS, e2el=MS")
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class BenchConfig:
    url: str
    endpoint: str = "completions"
    model: str | None = None  # None: the first id from GET /v1/models
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    # shared-prefix: this many system prompts of prefix_len tokens, shared by the requests.
    num_prefixes: int = 4
    prefix_len: int = 256
    # A tokenizer.json to count prompt tokens locally; None asks the server's /tokenize.
    tokenizer: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 is Poisson
    seed: int = 0
    duration: float | None = None  # s; no request starts after it
    timeout: float = 60.0  # s without a byte before a request fails
    slo: SLO | None = None
    cost_per_hour: float | None = None  # USD for the server's machine
    output: str | None = None  # JSON result file
    metadata: dict[str, str] = field(default_factory=dict)
    # --sweep: one run per rate, rising until the SLO fails (see inferd.bench.sweep).
    sweep: bool = False
    sweep_rates: tuple[float, ...] | None = None  # None: sweep_start doubling up to sweep_max
    sweep_start: float = 0.5  # requests/s
    sweep_max: float = 64.0  # requests/s
    slo_attainment: float = 0.9  # fraction of requests that must meet the SLO for a rate to hold
    plot: str | None = None  # PNG (or SVG/PDF) file; needs matplotlib

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {list(DATASETS)}, got {self.dataset!r}")
        if (self.dataset == "jsonl") != (self.dataset_path is not None):
            raise ValueError("dataset_path is required with --dataset jsonl and only with it")
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise ValueError(f"tokenizer: no such file {self.tokenizer!r}")
        for name in ("num_prompts", "input_len", "output_len", "num_prefixes", "prefix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout}")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise ValueError(f"cost_per_hour must be >= 0, got {self.cost_per_hour}")
        if not 0.0 < self.slo_attainment <= 1.0:
            raise ValueError(f"slo_attainment must be in (0, 1], got {self.slo_attainment}")
        if self.plot is not None and not self.plot.lower().endswith(PLOT_FORMATS):
            raise ValueError(f"plot must end in one of {', '.join(PLOT_FORMATS)}, got {self.plot!r}")
        self._check_sweep()

    def _check_sweep(self) -> None:
        if not self.sweep:
            if self.sweep_rates is not None:
                raise ValueError("sweep_rates is only for --sweep")
            return
        if self.slo is None:
            raise ValueError("slo is required with --sweep: it decides whether a rate held")
        if math.isfinite(self.request_rate):
            raise ValueError("request_rate: --sweep sets the rate of each step; give --sweep-rates instead")
        if self.sweep_rates is not None:
            rates = self.sweep_rates
            if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
                raise ValueError(f"sweep_rates must be finite requests/s > 0, got {list(rates)}")
            if any(b <= a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"sweep_rates must rise, got {list(rates)}")
            return
        if not (self.sweep_start > 0 and math.isfinite(self.sweep_start)):
            raise ValueError(f"sweep_start must be a finite requests/s > 0, got {self.sweep_start}")
        if not (self.sweep_max >= self.sweep_start and math.isfinite(self.sweep_max)):
            raise ValueError(f"sweep_max must be finite and >= sweep_start ({self.sweep_start}), got {self.sweep_max}")

    def rates(self) -> list[float]:
        """The sweep's rates in order: --sweep-rates as given, else --sweep-start
        doubling while it stays <= --sweep-max (0.5, 1, 2, ..., 64 by default)."""
        if self.sweep_rates is not None:
            return list(self.sweep_rates)
        rates, rate = [], self.sweep_start
        while rate <= self.sweep_max * (1 + 1e-9):  # 0.1 doubled is not exact
            rates.append(rate)
            rate *= 2
        return rates


def _slo(text: str) -> SLO:
    try:
        return SLO.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> float:
    try:
        return float(text)  # "inf" parses too
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s or inf, got {text!r}") from None


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s separated by commas, e.g. 0.5,1,2,4, got {text!r}") from None


def _metadata(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000")
    g = p.add_argument_group("target")
    g.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS), help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds without a byte before a request fails as `timeout`")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="random", choices=DATASETS, help="random: synthetic prompts; shared-prefix: --num-prefixes system prompts x questions; jsonl: --dataset-path")
    g.add_argument("--dataset-path", default=None, help='JSONL file, one {"prompt": ...} or {"messages": [...]} per line, optional "max_tokens"')
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts the requests share")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each shared system prompt")
    g.add_argument("--tokenizer", default=None, metavar="tokenizer.json", help="count prompt tokens with this local file (default: the server's /tokenize)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens per request (jsonl: unless the line sets it)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, or inf to send all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson, <1: burstier)")
    g.add_argument("--duration", type=float, default=None, help="seconds after which no new request starts")
    g = p.add_argument_group("report")
    g.add_argument("--slo", type=_slo, default=None, metavar="ttft=MS,tpot=MS,e2el=MS", help="goodput counts requests meeting all of these")
    g.add_argument("--cost-per-hour", type=float, default=None, metavar="USD", help="the server's price, for cost per 1M output tokens")
    g.add_argument("--output", "-o", default=None, metavar="FILE.json", help="write the full result as JSON")
    g.add_argument("--metadata", type=_metadata, action="append", default=[], metavar="KEY=VALUE", help="recorded in the JSON (repeatable)")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency plots (needs matplotlib: pip install 'inferd[bench]')")
    g = p.add_argument_group("sweep", "raise the request rate step by step until the SLO fails")
    g.add_argument("--sweep", action="store_true", help="run --num-prompts at each rate; report the highest that held (needs --slo)")
    g.add_argument("--sweep-rates", type=_rates, default=None, metavar="R1,R2,...", help="rising requests/s to try (default: --sweep-start doubling up to --sweep-max)")
    g.add_argument("--sweep-start", type=float, default=0.5, metavar="REQ/S", help="first rate of the default series")
    g.add_argument("--sweep-max", type=float, default=64.0, metavar="REQ/S", help="the default series stops at or below it")
    g.add_argument("--slo-attainment", type=float, default=0.9, metavar="FRACTION", help="a rate holds when this fraction of requests meet the SLO and none fails")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        url=a.url,
        endpoint=a.endpoint,
        model=a.model,
        api_key=a.api_key,
        dataset=a.dataset,
        dataset_path=a.dataset_path,
        num_prefixes=a.num_prefixes,
        prefix_len=a.prefix_len,
        tokenizer=a.tokenizer,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        concurrency=a.concurrency,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        seed=a.seed,
        duration=a.duration,
        timeout=a.timeout,
        slo=a.slo,
        cost_per_hour=a.cost_per_hour,
        output=a.output,
        metadata=dict(a.metadata),
        sweep=a.sweep,
        sweep_rates=a.sweep_rates,
        sweep_start=a.sweep_start,
        sweep_max=a.sweep_max,
        slo_attainment=a.slo_attainment,
        plot=a.plot,
    )
