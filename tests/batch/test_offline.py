"""``inferd batch`` as a real process on the default model: a 200-line file
answered once per custom_id and as the online endpoint answers, a SIGKILL
midway and a rerun, and bad lines in the errors file."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferd.engine.engine import LLMEngine
from tests.server.conftest import engine_config, live_server

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory-gb", "0.3", "--max-model-len", "1024", "--no-progress"]
TOPICS = ["rivers", "colours", "planets", "fruits", "tools", "birds", "cities", "metals"]


def _requests(n: int, max_tokens: int) -> list[dict]:
    lines = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            body = {"model": "batch-model", "prompt": f"{i}. A list of {topic}:", "max_tokens": max_tokens, "temperature": 0}
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body})
        else:
            messages = [{"role": "user", "content": f"Name {i % 5 + 2} {topic}."}]
            body = {"model": "batch-model", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def _write(path: Path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def _batch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "inferd.cli", "batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), *ENGINE_ARGS, *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_line_answered_once_as_the_online_endpoint_answers(tmp_path):
    requests = _requests(200, max_tokens=8)
    _write(tmp_path / "in.jsonl", requests)
    proc = _batch(tmp_path)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert "200 requests: 200 answered" in stderr
    results = _read(tmp_path / "out.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(r["custom_id"] for r in requests)
    assert not (tmp_path / "out.errors.jsonl").read_text()
    by_id = {r["custom_id"]: r["response"] for r in results}
    assert all(r["status_code"] == 200 and r["body"]["model"] == "batch-model" for r in by_id.values())

    # The same bodies through the HTTP server: the same text (greedy).
    import httpx

    engine = LLMEngine(engine_config(kv_cache_memory_gb=0.3, num_kv_blocks=None))
    server = live_server(engine)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for request in requests[:40]:
                body = request["body"] | {"model": None}
                online = c.post(request["url"], json=body).json()
                batch = by_id[request["custom_id"]]["body"]
                assert batch["usage"] == online["usage"]
                if request["url"] == "/v1/completions":
                    assert batch["choices"][0]["text"] == online["choices"][0]["text"]
                else:
                    assert batch["choices"][0]["message"] == online["choices"][0]["message"]
    finally:
        server.stop()


def test_sigkill_midway_then_rerun_completes_with_no_duplicate(tmp_path):
    requests = _requests(200, max_tokens=16)
    _write(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out.jsonl"
    proc = _batch(tmp_path, "--max-in-flight", "16")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 40:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    partial = out.read_bytes().count(b"\n")
    assert 40 <= partial < 200

    again = _batch(tmp_path)
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    assert f"resuming: {partial} of 200 requests already answered" in stderr
    ids = collections.Counter(r["custom_id"] for r in _read(out))
    assert set(ids) == {r["custom_id"] for r in requests}
    assert max(ids.values()) == 1


def test_malformed_lines_land_in_the_errors_file_and_the_rest_run(tmp_path):
    good = _requests(4, max_tokens=2)
    lines = [
        good[0],
        "{this is not json",
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/images", "body": {}},
        {"custom_id": "bad-body", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
        good[1],
        good[0],  # the same custom_id again
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions", "body": {"prompt": "word " * 2000}},
        good[2],
    ]
    _write(tmp_path / "in.jsonl", lines)
    proc = _batch(tmp_path, "--errors", str(tmp_path / "bad.jsonl"))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert sorted(r["custom_id"] for r in _read(tmp_path / "out.jsonl")) == ["req-0", "req-1", "req-2"]
    errors = {e["line"]: e for e in _read(tmp_path / "bad.jsonl")}
    assert sorted(errors) == [2, 3, 4, 6, 7]
    assert errors[2]["error"]["code"] == "invalid_json"
    assert errors[3]["error"]["code"] == "invalid_url" and errors[3]["custom_id"] == "bad-url"
    assert errors[4]["error"]["code"] == "invalid_body" and "max_tokens" in errors[4]["error"]["message"]
    assert errors[6]["error"]["code"] == "duplicate_custom_id"
    # Valid in form, refused by the engine: the response the endpoint would give.
    assert errors[7]["response"]["status_code"] == 400
    assert errors[7]["error"]["code"] == "context_length_exceeded"


def test_a_missing_input_file_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "inferd.cli", "batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "input: no such file" in proc.stderr


@pytest.fixture(autouse=True)
def _no_stray(tmp_path):  # noqa: ANN202
    yield
    subprocess.run(["pkill", "-9", "-f", str(tmp_path / "in.jsonl")], check=False)
