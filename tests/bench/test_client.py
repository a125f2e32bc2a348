"""inferd.bench against a misbehaving server: each failure is a failed request
of the right kind, and the run neither crashes nor hangs."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from inferd.bench.config import BenchConfig
from inferd.bench.main import run
from tests.bench.fake_server import CHUNK_GAP_S, FakeServer


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


def bench(url: str, tmp_path, **overrides) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    cfg = BenchConfig(url=url, num_prompts=3, input_len=4, output_len=4, timeout=0.5, output=str(out), **overrides)
    rc = run(cfg, Console(file=io.StringIO(), width=120))
    return rc, json.loads(out.read_text())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("behaviour", "kind"),
    [
        ("http500", "http_500"),
        ("drop", "connection"),
        ("error_event", "error_event"),
        ("stall", "timeout"),
        ("stall_headers", "timeout"),
        ("incomplete", "incomplete"),
        ("garbage", "invalid_event"),
    ],
)
def test_each_failure_is_reported_by_kind(fake, tmp_path, behaviour, kind):
    start = time.monotonic()
    rc, result = bench(f"{fake.url}/{behaviour}", tmp_path, concurrency=2)
    assert rc == 1  # nothing completed
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["errors_by_kind"] == {kind: 3}
    assert result["error_kinds"] == [kind] * 3
    assert all(result["errors"])
    assert result["model_id"] == f"fake-{behaviour}"
    assert result["mean_ttft_ms"] is None and result["request_throughput"] == 0
    assert time.monotonic() - start < 10


def test_error_event_keeps_the_servers_message(fake, tmp_path):
    _, result = bench(f"{fake.url}/error_event", tmp_path)
    assert result["errors"] == ["engine step failed"] * 3


def test_a_good_stream_is_timed_and_counted_from_usage(fake, tmp_path):
    rc, result = bench(f"{fake.url}/ok", tmp_path, model="m")
    assert rc == 0
    assert (result["completed"], result["failed"], result["errors_by_kind"]) == (3, 0, {})
    assert result["model_id"] == "m"
    # The fake sends 4 text chunks and usage 7 in / 4 out; it has no /tokenize.
    assert result["output_lens"] == [4, 4, 4] and result["input_lens"] == [7, 7, 7]
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (21, 12)
    assert all(len(itl) == 3 and min(itl) >= CHUNK_GAP_S * 0.5 for itl in result["itls"])
    assert all(t < e for t, e in zip(result["ttfts"], result["e2els"]))
    assert any("no POST /tokenize" in n for n in result["notes"])


def test_without_usage_output_tokens_are_chunks_counted(fake, tmp_path):
    _, result = bench(f"{fake.url}/nousage", tmp_path)
    assert result["output_lens"] == [4, 4, 4]
    assert result["input_lens"] == [4, 4, 4]  # the dataset's word-count guess
    assert any("no usage chunk" in n for n in result["notes"])


@pytest.mark.timeout(30)
def test_a_refused_connection_is_a_connection_error(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, result = bench(f"http://127.0.0.1:{port}", tmp_path, model="m")
    assert rc == 1 and result["errors_by_kind"] == {"connection": 3}


def test_no_models_and_no_model_flag_is_a_clear_error(tmp_path, capsys):
    cfg = BenchConfig(url="http://127.0.0.1:1", num_prompts=1, timeout=0.5)
    assert run(cfg, Console(file=io.StringIO())) == 1
    assert "pass --model" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("behaviour", "rc", "steps", "held"), [("ok", 0, 2, 100.0), ("http500", 1, 1, None)])
def test_a_sweep_holds_only_without_failures(fake, tmp_path, behaviour, rc, steps, held):
    from inferd.bench.config import SLO

    out = tmp_path / "s.json"
    cfg = BenchConfig(
        url=f"{fake.url}/{behaviour}", model="m", num_prompts=3, input_len=4, output_len=4, timeout=0.5, output=str(out),
        sweep=True, sweep_rates=(50.0, 100.0), slo=SLO(e2el_ms=60_000), slo_attainment=0.5,
    )  # fmt: skip
    assert run(cfg, Console(file=io.StringIO(), width=120)) == rc  # 1: the first step completed nothing
    r = json.loads(out.read_text())
    assert len(r["sweep"]) == steps and r["max_rate_held"] == held
    assert r["sweep"][-1]["failed"] == (0 if behaviour == "ok" else 3)
    assert any("no POST /tokenize" in n for n in r["notes"])  # the sweep's notes, once
