"""The Batch API's store: files and batches in SQLite, surviving a reopen."""

from __future__ import annotations

import io
import json

import pytest

from inferd.batch.store import COMPLETION_WINDOW_S, BatchStore, default_data_dir
from inferd.batch.upload import FileTooLarge, InvalidFile, copy_batch_input


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _jsonl(n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {}}).encode() + b"\n" for i in range(n))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock) -> BatchStore:
    s = BatchStore(tmp_path / "batch", clock)
    yield s
    s.close()


def test_default_data_dir_reads_inferd_home_at_call_time(tmp_path):
    assert default_data_dir({"INFERD_HOME": str(tmp_path)}) == tmp_path
    assert default_data_dir({}).name == ".inferd"


def test_upload_is_stored_and_survives_reopening(tmp_path, store, clock):
    record = store.add_upload(io.BytesIO(_jsonl(3)), "in.jsonl", max_bytes=10_000)
    assert record.id.startswith("file-") and record.bytes == len(_jsonl(3))
    assert record.to_openai() == {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": 1_700_000_000,
                                  "filename": "in.jsonl", "purpose": "batch", "status": "processed"}  # fmt: skip
    store.close()
    again = BatchStore(tmp_path / "batch", clock)
    assert again.get_file(record.id) == record
    assert again.content_path(record).read_bytes() == _jsonl(3)
    again.close()


def test_upload_checks(tmp_path):
    with pytest.raises(FileTooLarge, match="limit of 10 bytes"):
        copy_batch_input(io.BytesIO(_jsonl(1)), tmp_path / "a", max_bytes=10)
    with pytest.raises(InvalidFile, match="line 2 is not valid JSON"):
        copy_batch_input(io.BytesIO(b'{"a": 1}\n{oops\n'), tmp_path / "b", max_bytes=1000)
    with pytest.raises(InvalidFile, match="line 1 is not a JSON object"):
        copy_batch_input(io.BytesIO(b"[1, 2]"), tmp_path / "c", max_bytes=1000)
    with pytest.raises(InvalidFile, match="more than 2 requests"):
        copy_batch_input(io.BytesIO(_jsonl(3)), tmp_path / "d", max_bytes=10_000, max_lines=2)
    with pytest.raises(InvalidFile, match="no requests"):
        copy_batch_input(io.BytesIO(b"\n\n"), tmp_path / "e", max_bytes=1000)
    # Blank lines and a last line without a newline are fine.
    assert copy_batch_input(io.BytesIO(b'{"a": 1}\n\n{"b": 2}'), tmp_path / "f", max_bytes=1000) == 18


def test_failed_upload_leaves_no_file(store):
    with pytest.raises(InvalidFile):
        store.add_upload(io.BytesIO(b"nope\n"), "x.jsonl", max_bytes=1000)
    assert list((store.root / "files").iterdir()) == []
    assert store.list_files() == ([], False)


def test_batch_lifecycle_to_completed_registers_result_files(store, clock):
    upload = store.add_upload(io.BytesIO(_jsonl(2)), "in.jsonl", max_bytes=10_000)
    batch = store.create_batch(upload.id, "/v1/completions", {"k": "v"})
    assert batch.status == "validating" and batch.expires_at == 1_700_000_000 + COMPLETION_WINDOW_S
    clock.t += 1
    store.mark_in_progress(batch.id)
    store.mark_in_progress(batch.id)  # idempotent: keeps the first stamp
    clock.t += 1
    store.set_counts(batch.id, total=2, completed=1, failed=1)
    out, err = store.result_paths(batch.id)
    out.write_text('{"custom_id": "r0"}\n')
    err.write_text("")  # no errors: no error file
    store.set_status(batch.id, "finalizing")
    clock.t += 1
    done = store.finish(batch.id, "completed")
    body = done.to_openai()
    assert (body["status"], body["in_progress_at"], body["finalizing_at"], body["completed_at"]) == (
        "completed", 1_700_000_001, 1_700_000_002, 1_700_000_003)
    assert body["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert body["metadata"] == {"k": "v"} and body["errors"] is None and body["error_file_id"] is None
    output = store.get_file(body["output_file_id"])
    assert (output.purpose, output.filename, output.bytes) == ("batch_output", f"{batch.id}_output.jsonl", out.stat().st_size)
    assert store.content_path(output) == out


def test_transitions_are_checked(store):
    batch = store.create_batch("file-x", "/v1/completions")
    with pytest.raises(ValueError, match="cannot go from validating to completed"):
        store.set_status(batch.id, "completed")
    store.set_status(batch.id, "cancelling")
    with pytest.raises(ValueError, match="cannot go from cancelling to in_progress"):
        store.set_status(batch.id, "in_progress")
    store.mark_in_progress(batch.id)  # no-op once cancelling
    assert store.get_batch(batch.id).status == "cancelling"
    assert store.finish(batch.id, "cancelled").status == "cancelled"
    with pytest.raises(ValueError, match="cannot go from cancelled to failed"):
        store.set_status(batch.id, "failed")
    failed = store.set_status(store.create_batch("file-x", "/v1/completions").id, "failed",
                              [{"code": "mismatched_url", "message": "m", "line": 1}])  # fmt: skip
    assert failed.to_openai()["errors"] == {"object": "list", "data": [{"code": "mismatched_url", "message": "m", "line": 1}]}


def test_active_batches_come_oldest_first_and_state_survives_reopening(tmp_path, store, clock):
    a = store.create_batch("file-a", "/v1/completions")
    b = store.create_batch("file-b", "/v1/chat/completions")
    c = store.create_batch("file-c", "/v1/completions")
    store.mark_in_progress(b.id)
    store.set_counts(b.id, 10, 4, 1)
    store.set_status(a.id, "cancelling")
    assert store.next_active().id == b.id
    assert [x.id for x in store.with_status("cancelling")] == [a.id]
    assert store.inputs_in_use("file-a") == [a.id] and store.inputs_in_use("file-zzz") == []
    store.close()
    again = BatchStore(tmp_path / "batch", clock)
    resumed = again.get_batch(b.id)
    assert (resumed.status, resumed.total, resumed.completed, resumed.failed) == ("in_progress", 10, 4, 1)
    page, more = again.list_batches(limit=2)
    assert [x.id for x in page] == [c.id, b.id] and more
    page, more = again.list_batches(after=b.id, limit=2)
    assert [x.id for x in page] == [a.id] and not more
    with pytest.raises(KeyError):
        again.list_batches(after="batch_nope")
    again.close()


def test_files_list_order_purpose_and_delete(store):
    f1 = store.add_upload(io.BytesIO(_jsonl(1)), "1.jsonl", max_bytes=1000)
    f2 = store.add_upload(io.BytesIO(_jsonl(1)), "2.jsonl", max_bytes=1000)
    assert [f.id for f in store.list_files()[0]] == [f2.id, f1.id]
    assert [f.id for f in store.list_files(ascending=True, limit=1)[0]] == [f1.id]
    assert [f.id for f in store.list_files(after=f1.id, ascending=True)[0]] == [f2.id]
    assert store.list_files(purpose="batch_output") == ([], False)
    assert store.delete_file(f1.id) and not store.delete_file(f1.id)
    assert store.get_file(f1.id) is None and not store.content_path(f1).exists()
