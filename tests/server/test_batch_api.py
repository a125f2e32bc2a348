"""The OpenAI Batch API (/v1/files, /v1/batches) on a live server, driven
by the official client: results, errors, cancel, expiry, validation, and a
job that survives its server being SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from inferd.engine.engine import LLMEngine
from tests.server.conftest import LiveServer, engine_config, live_server

INFERD = Path(sys.executable).parent / "inferd"
MAX_FILE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory) -> Iterator[LiveServer]:
    # max_num_seqs 8: batch jobs take at most 4 seats.
    engine = LLMEngine(engine_config(max_num_seqs=8, num_kv_blocks=512))
    data_dir = tmp_path_factory.mktemp("inferd-home")
    live = live_server(engine, served_model_name="smol", data_dir=str(data_dir), max_file_bytes=MAX_FILE_BYTES)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(batch_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{batch_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(i: int, max_tokens: int = 8, **extra) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": f"Say a word about the number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip


def _upload(client: openai.OpenAI, tmp_path: Path, lines: list[str], name: str = "in.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until, timeout: float = 120):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s: {batch.request_counts}")


def _ended(batch) -> bool:  # noqa: ANN001
    return batch.status in ("completed", "failed", "expired", "cancelled")


def _content(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_routes_are_in_the_openapi_document(batch_server):
    paths = httpx.get(f"{batch_server.url}/openapi.json").json()["paths"]
    assert {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
            "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel"} <= set(paths)  # fmt: skip


def test_a_batch_end_to_end_with_the_official_client(batch_server, client, tmp_path):
    lines = [_line(f"chat-{i}", "/v1/chat/completions", _chat(i)) for i in range(17)]
    lines.insert(5, _line("wrong-url", "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 4}))
    lines.insert(9, _line("wrong-url-2", "/v1/completions", {"prompt": "Hello", "max_tokens": 4}))
    lines.insert(12, _line("no-messages", "/v1/chat/completions", {"model": "smol", "max_tokens": 4}))
    file_id = _upload(client, tmp_path, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "e2e"})  # fmt: skip
    assert (batch.status, batch.object, batch.metadata) == ("validating", "batch", {"job": "e2e"})
    assert batch.expires_at == batch.created_at + 24 * 3600
    batch = _wait(client, batch.id, _ended)

    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (20, 17, 3)
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = _content(client, batch.output_file_id)
    assert sorted(e["custom_id"] for e in output) == sorted(f"chat-{i}" for i in range(17))
    for entry in output:
        i = int(entry["custom_id"].split("-")[1])
        assert entry["response"]["status_code"] == 200 and entry["error"] is None
        alone = client.chat.completions.create(**_chat(i))
        assert entry["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert entry["response"]["body"]["model"] == "smol"
    errors = {e["custom_id"]: e for e in _content(client, batch.error_file_id)}
    assert set(errors) == {"wrong-url", "wrong-url-2", "no-messages"}
    assert errors["wrong-url"]["error"]["code"] == "mismatched_url"
    assert "does not match the batch endpoint" in errors["wrong-url"]["error"]["message"]
    assert errors["no-messages"]["error"] == {"code": "invalid_body", "message": "body.messages: Field required"}
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_an_interactive_request_is_answered_while_a_batch_runs(batch_server, client, tmp_path):
    # More lines than it will run: it is cancelled once the point is made.
    lines = [_line(f"r{i}", "/v1/chat/completions", _chat(i, max_tokens=24, ignore_eos=True)) for i in range(64)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    _wait(client, batch.id, lambda b: b.status == "in_progress")
    start = time.monotonic()
    reply = client.chat.completions.create(**_chat(99, max_tokens=4))
    assert reply.choices[0].message.content and time.monotonic() - start < 20
    assert client.batches.retrieve(batch.id).status == "in_progress"  # it really ran beside the batch
    client.batches.cancel(batch.id)
    _wait(client, batch.id, _ended)


def test_cancel_stops_feeding_and_keeps_what_was_done(batch_server, client, tmp_path):
    lines = [_line(f"r{i}", "/v1/chat/completions", _chat(i, max_tokens=24, ignore_eos=True)) for i in range(64)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    _wait(client, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed >= 1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    batch = _wait(client, batch.id, _ended)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.total == 64 and 1 <= counts.completed < 64 and counts.failed == 0
    output = _content(client, batch.output_file_id)
    ids = [e["custom_id"] for e in output]
    assert len(ids) == len(set(ids)) == counts.completed and batch.error_file_id is None
    assert client.batches.cancel(batch.id).status == "cancelled"  # idempotent


def test_every_line_on_another_endpoint_fails_the_batch(batch_server, client, tmp_path):
    lines = [_line(f"c{i}", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}) for i in range(3)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    batch = _wait(client, batch.id, _ended, timeout=30)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("mismatched_url", 1), ("mismatched_url", 2), ("mismatched_url", 3)]
    assert batch.output_file_id is None and batch.error_file_id is None
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_with_every_line_unrun(batch_server, client, tmp_path, monkeypatch):
    monkeypatch.setattr("inferd.batch.store.COMPLETION_WINDOW_S", 0)
    lines = [_line(f"x{i}", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}) for i in range(3)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path, lines), endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    batch = _wait(client, batch.id, _ended, timeout=30)
    assert batch.status == "expired" and batch.expired_at is not None and batch.output_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 0, 3)
    errors = _content(client, batch.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["x0", "x1", "x2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def _param(error: openai.APIStatusError) -> str | None:
    return error.response.json()["error"]["param"]


def test_validation_errors_are_openai_shaped(batch_server, client, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(_line("a", "/v1/completions", {"prompt": "Hi"}) + "\n")
    with open(path, "rb") as f, pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=f, purpose="fine-tune")
    assert _param(e.value) == "purpose"
    path.write_text("not json\n")
    with open(path, "rb") as f, pytest.raises(openai.BadRequestError, match="line 1 is not valid JSON"):
        client.files.create(file=f, purpose="batch")
    path.write_text(_line("a", "/v1/completions", {"prompt": "x" * MAX_FILE_BYTES}) + "\n")
    with open(path, "rb") as f, pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=f, purpose="batch")
    assert e.value.status_code == 413
    for call in (lambda: client.files.retrieve("file-nope"), lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()

    file_id = _upload(client, tmp_path, [_line("a", "/v1/completions", {"prompt": "Hi"})], "ok.jsonl")
    create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**(create | {"completion_window": "1h"}))
    assert _param(e.value) == "completion_window" and "completion_window" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(**(create | {"input_file_id": "file-nope"}))
    assert _param(e.value) == "input_file_id"
    with pytest.raises(openai.BadRequestError, match="not served yet") as e:
        client.batches.create(**(create | {"endpoint": "/v1/embeddings"}))
    assert _param(e.value) == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**create, metadata={f"k{i}": "v" for i in range(17)})
    assert _param(e.value) == "metadata"


def test_files_list_and_delete(batch_server, client, tmp_path):
    first = _upload(client, tmp_path, [_line("a", "/v1/completions", {"prompt": "Hi"})], "first.jsonl")
    second = _upload(client, tmp_path, [_line("b", "/v1/completions", {"prompt": "Hi"})], "second.jsonl")
    ids = [f.id for f in client.files.list(purpose="batch")]
    assert ids.index(second) < ids.index(first)  # newest first
    page = client.files.list(limit=1, order="asc", after=first)
    assert page.data[0].id == second
    assert client.files.content(first).text == _line("a", "/v1/completions", {"prompt": "Hi"}) + "\n"
    deleted = client.files.delete(first)
    assert (deleted.id, deleted.deleted) == (first, True)
    assert first not in [f.id for f in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.content(first)
    batches = client.batches.list(limit=2)
    assert len(batches.data) == 2 and batches.has_more
    newer, older = batches.data
    assert newer.created_at >= older.created_at
    assert client.batches.list(limit=1, after=newer.id).data[0].id == older.id


def test_one_server_per_data_dir_runs_the_jobs(batch_server):
    from inferd.batch.store import BatchStore
    from inferd.batch.worker import BatchWorker

    api = batch_server.state.batch
    assert api.worker.runs_jobs
    store = BatchStore(api.root)  # as a second server on the same data dir would open it
    other = BatchWorker(store, api.worker.serving, max_in_flight=1)
    assert not other._try_lock()
    store.close()


# A job that survives a SIGKILL ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [str(INFERD), "serve", "--port", str(port), "--kv-cache-memory-gb", "0.2", "--max-model-len", "1024",
         "--max-num-seqs", "16", "--data-dir", str(data_dir)],
        stdout=open(log, "a"), stderr=subprocess.STDOUT,  # noqa: SIM115 - the child holds it
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"inferd serve did not become healthy:\n{log.read_text()}")


def test_a_sigkilled_server_resumes_its_batch_and_answers_each_line_once(tmp_path):
    log = tmp_path / "serve.log"
    proc, url = _serve(tmp_path / "home", log)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        lines = [_line(f"r{i}", "/v1/chat/completions", _chat(i, max_tokens=24, ignore_eos=True)) for i in range(60)]
        batch = client.batches.create(input_file_id=_upload(client, tmp_path, lines), endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        seen = _wait(client, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed >= 5)
        assert seen.status == "in_progress" and seen.request_counts.completed < 60
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        proc, url = _serve(tmp_path / "home", log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.batches.retrieve(batch.id).request_counts.completed >= 5  # what was done is kept
        batch = _wait(client, batch.id, _ended)
        assert batch.status == "completed", log.read_text()
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (60, 60, 0)
        ids = [e["custom_id"] for e in _content(client, batch.output_file_id)]
        assert sorted(ids) == sorted(f"r{i}" for i in range(60))
        assert "resuming" in log.read_text()
        assert batch.error_file_id is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

