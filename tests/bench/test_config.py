"""``inferd bench`` flags -> BenchConfig, and clear errors for bad ones."""

from __future__ import annotations

import math

import pytest

from inferd.bench.config import SLO, BenchConfig
from inferd.cli import parse_config


def test_flags_flow_into_a_bench_config():
    cfg = parse_config([
        "bench", "http://127.0.0.1:1/v1/", "--endpoint", "chat", "--model", "m", "--num-prompts", "8",
        "--input-len", "32", "--output-len", "8", "--range-ratio", "0.25", "--concurrency", "4",
        "--request-rate", "2.5", "--burstiness", "0.5", "--seed", "7", "--duration", "30", "--timeout", "5",
        "--slo", "ttft=500,tpot=50", "--cost-per-hour", "2.5", "--output", "r.json", "--metadata", "gpu=none",
    ])  # fmt: skip
    assert isinstance(cfg, BenchConfig)
    assert cfg.url == "http://127.0.0.1:1"  # trailing /v1 and slash dropped
    assert (cfg.endpoint, cfg.model, cfg.num_prompts, cfg.input_len, cfg.output_len) == ("chat", "m", 8, 32, 8)
    assert (cfg.range_ratio, cfg.concurrency, cfg.request_rate, cfg.burstiness, cfg.seed) == (0.25, 4, 2.5, 0.5, 7)
    assert (cfg.duration, cfg.timeout, cfg.cost_per_hour, cfg.output) == (30.0, 5.0, 2.5, "r.json")
    assert cfg.slo == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert cfg.metadata == {"gpu": "none"}


def test_defaults():
    cfg = parse_config(["bench", "http://127.0.0.1:1"])
    assert (cfg.endpoint, cfg.dataset, cfg.model, cfg.concurrency, cfg.slo) == ("completions", "random", None, None, None)
    assert math.isinf(cfg.request_rate) and cfg.burstiness == 1.0 and cfg.num_prompts == 100
    assert math.isinf(parse_config(["bench", "http://x", "--request-rate", "inf"]).request_rate)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--concurrency", "0"], "concurrency"),
        (["--request-rate", "0"], "request_rate"),
        (["--burstiness", "-1"], "burstiness"),
        (["--num-prompts", "0"], "num_prompts"),
        (["--range-ratio", "1"], "range_ratio"),
        (["--timeout", "0"], "timeout"),
        (["--dataset", "jsonl"], "dataset_path"),
        (["--dataset-path", "x.jsonl"], "dataset_path"),
    ],
)
def test_bad_values_name_the_field(flags, field):
    with pytest.raises(ValueError, match=field):
        parse_config(["bench", "http://127.0.0.1:1", *flags])


def test_a_url_without_a_scheme_is_refused():
    with pytest.raises(ValueError, match="url must start with http"):
        parse_config(["bench", "127.0.0.1:8000"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slo", "ttft=fast"], "ttft must be a number of ms"),
        (["--slo", "latency=5"], "expected ttft=MS"),
        (["--slo", "tpot=0"], "tpot must be > 0"),
        (["--request-rate", "lots"], "expected requests/s or inf"),
        (["--endpoint", "embeddings"], "invalid choice"),
        (["--metadata", "novalue"], "expected KEY=VALUE"),
    ],
)
def test_bad_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["bench", "http://127.0.0.1:1", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_bench_package_imports_nothing_else_of_inferd():
    import ast
    from pathlib import Path

    import inferd.bench

    for path in Path(inferd.bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith("inferd") or name.startswith("inferd.bench"), f"{path.name} imports {name}"
