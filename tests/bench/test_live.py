"""``inferd bench`` against a live inferd server on loopback."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
from rich.console import Console

from inferd.cli import main
from inferd.engine.engine import LLMEngine
from tests.server.conftest import LiveServer, engine_config, live_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = live_server(LLMEngine(engine_config(num_kv_blocks=256)), served_model_name="smol")
    yield live
    live.stop()


LATENCY_FIELDS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p95", "p99")]
FIELDS = [
    "completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "total_input_tokens", "total_output_tokens", "request_goodput", "errors", "errors_by_kind", "config",
    "ttfts", "itls", "output_lens", "input_lens", *LATENCY_FIELDS,
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_a_live_server(server, tmp_path, capsys, endpoint):
    out = tmp_path / "r.json"
    rc = main([
        "bench", server.url, "--endpoint", endpoint, "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
        "--concurrency", "4", "--slo", "ttft=60000,e2el=60000", "--cost-per-hour", "1.0", "--output", str(out),
    ])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(FIELDS) <= set(r)
    assert (r["completed"], r["failed"], r["errors_by_kind"]) == (8, 0, {})
    assert r["model_id"] == "smol" and r["config"]["model"] == "smol"
    assert r["total_output_tokens"] == 64 and r["output_lens"] == [8] * 8
    if endpoint == "completions":
        assert r["input_lens"] == [32] * 8  # fitted with the server's /tokenize
    else:
        assert all(n > 32 for n in r["input_lens"])  # the chat template adds tokens; usage says how many
    assert r["notes"] == []
    assert all(0 < t <= e for t, e in zip(r["ttfts"], r["e2els"]))
    assert all(len(itl) == 7 for itl in r["itls"])
    assert r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["p99_tpot_ms"] > 0
    assert 0 < r["request_throughput"] and r["request_throughput"] * r["duration"] == pytest.approx(8)
    assert r["output_throughput"] == pytest.approx(8 * r["request_throughput"])
    assert r["total_token_throughput"] > r["output_throughput"]
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a generous SLO: all good
    assert r["cost_per_million_output_tokens"] == pytest.approx(1.0 / 3600 * r["duration"] / 64 * 1e6)
    printed = capsys.readouterr().out
    assert "Successful requests" in printed and "Time to first token" in printed


@pytest.mark.timeout(120)
def test_a_request_rate_run_with_a_jsonl_dataset(server, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count to {i}:", "max_tokens": 4}) for i in range(4)) + "\n")
    out = tmp_path / "r.json"
    from inferd.bench.config import BenchConfig
    from inferd.bench.main import run

    cfg = BenchConfig(
        url=server.url, dataset="jsonl", dataset_path=str(data), num_prompts=4, request_rate=20.0, seed=1, output=str(out)
    )
    assert run(cfg, Console(file=io.StringIO())) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and all(0 < n <= 4 for n in r["output_lens"])
    assert r["request_rate"] == 20.0 and r["start_times"] == sorted(r["start_times"])
    assert all(n is not None and n > 0 for n in r["input_lens"])  # from usage


def _ttft_histogram(url: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, cumulative buckets) of the server's TTFT histogram."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    buckets = []
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name != "inferd:time_to_first_token_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
    return total, count, buckets


@pytest.mark.timeout(180)
def test_bench_ttft_agrees_with_the_servers_histogram(server, tmp_path):
    before_sum, before_count, before_buckets = _ttft_histogram(server.url)
    out = tmp_path / "r.json"
    rc = main(["bench", server.url, "--num-prompts", "12", "--input-len", "384", "--output-len", "4",
               "--concurrency", "3", "--output", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    after_sum, after_count, after_buckets = _ttft_histogram(server.url)
    assert after_count - before_count == 12
    server_mean_ms = (after_sum - before_sum) / 12 * 1000
    # The histogram's mean is exact; the client adds only HTTP on loopback.
    assert r["mean_ttft_ms"] == pytest.approx(server_mean_ms, rel=0.15)
    # The client's median lies in (or at the edge of) the histogram's median bucket.
    counts = [(le, a - b) for (le, a), (_, b) in zip(after_buckets, before_buckets)]
    median_le = next(le for le, c in counts if c >= 6)
    lower = max([le for le, c in counts if c < 6], default=0.0)
    assert lower * 1000 * 0.85 <= r["median_ttft_ms"] <= median_le * 1000 * 1.15


# --sweep and --plot against the live server: small steps, bounded time.

PNG = b"\x89PNG\r\n\x1a\n"
SWEEP = ["--sweep", "--sweep-rates", "4,8,16", "--num-prompts", "4", "--input-len", "32", "--output-len", "4", "--concurrency", "4"]


@pytest.mark.timeout(120)
def test_a_sweep_with_a_generous_slo_holds_every_rate(server, tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(["bench", server.url, *SWEEP, "--slo", "ttft=60000,e2el=60000", "--output", str(out), "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["max_rate_held"] == 16.0 and r["slo"] == {"ttft_ms": 60000.0, "e2el_ms": 60000.0}
    assert r["slo_attainment"] == 0.9 and r["sweep_rates"] == [4.0, 8.0, 16.0] and r["model_id"] == "smol"
    assert [s["request_rate"] for s in r["sweep"]] == [4.0, 8.0, 16.0]
    for step in r["sweep"]:
        assert step["held"] and (step["completed"], step["failed"]) == (4, 0)
        assert step["request_goodput"] == pytest.approx(step["request_throughput"])
        assert step["output_lens"] == [4] * 4 and step["input_lens"] == [32] * 4  # the same prompts each step
        assert set(LATENCY_FIELDS) <= set(step)
    printed = capsys.readouterr().out
    assert "highest rate that held: 16 req/s" in printed and "TTFT" in printed and "p99" in printed
    assert png.read_bytes()[:8] == PNG


@pytest.mark.timeout(120)
def test_a_sweep_with_an_impossible_slo_stops_at_the_first_step(server, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", server.url, *SWEEP, "--slo", "ttft=1", "--output", str(out)]) == 0  # it measured
    r = json.loads(out.read_text())
    assert r["max_rate_held"] is None and len(r["sweep"]) == 1
    assert not r["sweep"][0]["held"] and r["sweep"][0]["completed"] == 4
    assert "highest rate that held: none" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_single_run_plot_is_a_png(server, tmp_path):
    png = tmp_path / "run.png"
    rc = main(["bench", server.url, "--num-prompts", "4", "--input-len", "32", "--output-len", "4", "--slo", "ttft=60000",
               "--plot", str(png)])  # fmt: skip
    assert rc == 0 and png.read_bytes()[:8] == PNG


@pytest.mark.timeout(120)
def test_shared_prefix_workload_with_a_local_tokenizer(server, tmp_path):
    tokenizer_file = tmp_path / "tokenizer.json"
    server.engine.tokenizer.backend.save(str(tokenizer_file))
    out = tmp_path / "r.json"
    rc = main(["bench", server.url, "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "48",
               "--input-len", "16", "--output-len", "4", "--num-prompts", "6", "--concurrency", "3",
               "--tokenizer", str(tokenizer_file), "--output", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["total_output_tokens"] == 24
    # The server counts what the local file counted: each prompt is 48 + 16
    # fitted tokens plus the separator between them.
    assert all(64 <= n <= 66 for n in r["input_lens"]), r["input_lens"]
    assert main(["bench", server.url, "--tokenizer", str(tmp_path / "missing.json")]) == 2
