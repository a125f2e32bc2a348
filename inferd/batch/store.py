"""The Batch API's files and jobs: rows in SQLite, contents as plain files.

Layout under ``<data_dir>/batch/``::

    batch.db                      tables `files` and `batches`
    files/<file_id>               uploaded contents
    results/<batch_id>.output.jsonl, .errors.jsonl
                                  a job's results (``journal.ResultFile``),
                                  registered as `batch_output` files when it ends

A file row holds its content's path, so a job's result files become files
in the same transaction that ends the job: no rename can be cut half way.
Pure data: no FastAPI, no engine.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from inferd.batch.upload import copy_batch_input
from inferd.sqlite_db import Database, default_data_dir  # noqa: F401 - default_data_dir re-exported

SCHEMA_VERSION = 1
COMPLETION_WINDOW_S = 24 * 3600
ACTIVE = ("validating", "in_progress", "finalizing")  # resumed after a restart
TERMINAL = ("completed", "failed", "expired", "cancelled")
_ACTIVE_SQL = "(" + ", ".join(f"'{s}'" for s in ACTIVE) + ")"
# status -> the statuses it may move to.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "validating": ("in_progress", "failed", "cancelling", "expired"),
    "in_progress": ("finalizing", "failed", "cancelling", "expired"),
    "finalizing": ("completed", "failed"),
    "cancelling": ("cancelled",),
    **{s: () for s in TERMINAL},
}

_SCHEMA = (
    """CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
        path TEXT NOT NULL)""",
    """CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
        output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
        expires_at INTEGER NOT NULL, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
        expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
        total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
        metadata TEXT, errors TEXT)""",
    "CREATE INDEX batches_status ON batches (status, seq)",
)


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    path: str  # relative to the store's root

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}  # fmt: skip


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None

    def to_openai(self) -> dict[str, Any]:
        body = asdict(self)
        counts = {"total": body.pop("total"), "completed": body.pop("completed"), "failed": body.pop("failed")}
        errors = body.pop("errors")
        return {"id": body.pop("id"), "object": "batch", **body, "request_counts": counts,
                "errors": {"object": "list", "data": errors} if errors else None}  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(self, root: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.clock = clock
        for sub in ("files", "results"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # synchronous=NORMAL survives a killed process; a power cut may lose
        # the last counts, which a resumed job recounts from its files.
        self._db = Database(self.root / "batch.db", _SCHEMA, SCHEMA_VERSION, synchronous="NORMAL")
        self._tx = self._db.tx

    def close(self) -> None:
        self._db.close()

    def now(self) -> int:
        return int(self.clock())

    # Files ---------------------------------------------------------------------------

    def add_upload(self, src: IO[bytes], filename: str, max_bytes: int) -> FileRecord:
        """A `batch` input file, checked (``copy_batch_input``) and stored."""
        file_id = _new_id("file-")
        path = self.root / "files" / file_id
        try:
            size = copy_batch_input(src, path, max_bytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        record = FileRecord(file_id, size, self.now(), filename, "batch", f"files/{file_id}")
        with self._tx() as db:
            _insert_file(db, record)
        return record

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self._db.query(f"SELECT {_FILE_COLS} FROM files WHERE id = ?", (file_id,))
        return FileRecord(*rows[0]) if rows else None

    def list_files(self, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
                   ascending: bool = False) -> tuple[list[FileRecord], bool]:  # fmt: skip
        """A page of files and whether more follow; raises KeyError for an unknown ``after``."""
        rows = self._page("files", _FILE_COLS, after, limit, ascending, ("purpose", purpose))
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def content_path(self, record: FileRecord) -> Path:
        return self.root / record.path

    def delete_file(self, file_id: str) -> bool:
        record = self.get_file(file_id)
        if record is None:
            return False
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.content_path(record).unlink(missing_ok=True)
        return True

    # Batches -------------------------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None = None) -> BatchRecord:
        now = self.now()
        batch_id = _new_id("batch_")
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at,"
                " metadata) VALUES (?, ?, ?, '24h', 'validating', ?, ?, ?)",
                (batch_id, endpoint, input_file_id, now, now + COMPLETION_WINDOW_S,
                 json.dumps(metadata) if metadata is not None else None),
            )  # fmt: skip
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = self._db.query(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?", (batch_id,))
        return _batch(rows[0]) if rows else None

    def list_batches(self, after: str | None = None, limit: int = 20) -> tuple[list[BatchRecord], bool]:
        """Newest first; raises KeyError for an unknown ``after``."""
        rows = self._page("batches", _BATCH_COLS, after, limit, False)
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def next_active(self) -> BatchRecord | None:
        """The oldest batch still to run (FIFO by creation)."""
        rows = self._db.query(f"SELECT {_BATCH_COLS} FROM batches WHERE status IN {_ACTIVE_SQL} ORDER BY seq LIMIT 1")
        return _batch(rows[0]) if rows else None

    def with_status(self, status: str) -> list[BatchRecord]:
        rows = self._db.query(f"SELECT {_BATCH_COLS} FROM batches WHERE status = ? ORDER BY seq", (status,))
        return [_batch(r) for r in rows]

    def inputs_in_use(self, file_id: str) -> list[str]:
        """Batches that still read ``file_id``."""
        rows = self._db.query(
            f"SELECT id FROM batches WHERE input_file_id = ? AND (status IN {_ACTIVE_SQL} OR status = 'cancelling')",
            (file_id,),
        )
        return [r[0] for r in rows]

    def set_status(self, batch_id: str, status: str, errors: list[dict] | None = None) -> BatchRecord:
        """Moves a batch to ``status`` (stamping ``<status>_at``); ValueError
        if ``TRANSITIONS`` does not allow it."""
        with self._tx() as db:
            self._move(db, batch_id, status)
            if errors is not None:
                db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))
        return self.get_batch(batch_id)

    def mark_in_progress(self, batch_id: str) -> None:
        """validating -> in_progress; a no-op in any other state (a resumed
        job, or one cancelled meanwhile)."""
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND status = 'validating'",
                       (self.now(), batch_id))  # fmt: skip

    def set_counts(self, batch_id: str, total: int, completed: int, failed: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE batches SET total = ?, completed = ?, failed = ? WHERE id = ?",
                       (total, completed, failed, batch_id))  # fmt: skip

    def result_paths(self, batch_id: str) -> tuple[Path, Path]:
        base = self.root / "results" / batch_id
        return base.with_suffix(".output.jsonl"), base.with_suffix(".errors.jsonl")

    def finish(self, batch_id: str, status: str) -> BatchRecord:
        """Ends a batch as ``status``, registering its non-empty result
        files as `batch_output` files, all in one transaction."""
        out_path, err_path = self.result_paths(batch_id)
        now = self.now()
        with self._tx() as db:
            self._move(db, batch_id, status)
            for column, path, name in (("output_file_id", out_path, "output"), ("error_file_id", err_path, "error")):
                size = path.stat().st_size if path.exists() else 0
                if size:
                    record = FileRecord(_new_id("file-"), size, now, f"{batch_id}_{name}.jsonl", "batch_output",
                                        str(path.relative_to(self.root)))  # fmt: skip
                    _insert_file(db, record)
                    db.execute(f"UPDATE batches SET {column} = ? WHERE id = ?", (record.id, batch_id))
        return self.get_batch(batch_id)

    def _move(self, db: sqlite3.Connection, batch_id: str, status: str) -> None:
        row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise KeyError(batch_id)
        if status not in TRANSITIONS[row[0]]:
            raise ValueError(f"batch {batch_id} cannot go from {row[0]} to {status}")
        db.execute(f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ?", (status, self.now(), batch_id))

    def _page(self, table: str, cols: str, after: str | None, limit: int, ascending: bool,
              where: tuple[str, str | None] = ("1", None)) -> list[tuple]:  # fmt: skip
        clauses, params = [], []
        if where[1] is not None:
            clauses.append(f"{where[0]} = ?")
            params.append(where[1])
        with self._tx() as db:  # one snapshot for the cursor and the page
            if after is not None:
                row = db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                clauses.append("seq > ?" if ascending else "seq < ?")
                params.append(row[0])
            sql = f"SELECT {cols} FROM {table}"
            if clauses:
                sql += " WHERE " + " AND ".join(clauses)
            sql += f" ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?"
            return db.execute(sql, (*params, limit + 1)).fetchall()

    def remove_results(self, batch_id: str) -> None:
        for path in self.result_paths(batch_id):
            path.unlink(missing_ok=True)


_FILE_COLS = ", ".join(f.name for f in fields(FileRecord))
_BATCH_COLS = ", ".join(f.name for f in fields(BatchRecord))


def _insert_file(db: sqlite3.Connection, record: FileRecord) -> None:
    db.execute(f"INSERT INTO files ({_FILE_COLS}) VALUES (?, ?, ?, ?, ?, ?)", tuple(asdict(record).values()))


def _batch(row: tuple) -> BatchRecord:
    *head, metadata, errors = row
    return BatchRecord(*head, json.loads(metadata) if metadata else None, json.loads(errors) if errors else None)
