"""One SQLite file shared by threads and processes, as the key store and
the batch store use it: WAL (readers never wait on a writer), explicit
``BEGIN IMMEDIATE`` transactions (a check-then-write holds the write lock
even across processes), and a schema version in ``user_version``."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where inferd keeps its state (keys, batch files and jobs): $INFERD_HOME,
    default ~/.inferd (read at call time, never at import)."""
    home = (os.environ if env is None else env).get("INFERD_HOME")
    return Path(home or "~/.inferd").expanduser()


class Database:
    def __init__(self, path: str | Path, schema: Sequence[str], version: int, synchronous: str = "FULL",
                 foreign_keys: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: the connection may pass between threads;
        # the lock keeps two from interleaving statements on it.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self._lock = threading.Lock()
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            if foreign_keys:
                self._db.execute("PRAGMA foreign_keys=ON")
            with self.tx() as db:
                found = db.execute("PRAGMA user_version").fetchone()[0]
                if found == 0:
                    for statement in schema:
                        db.execute(statement)
                    db.execute(f"PRAGMA user_version = {int(version)}")
                elif found != version:
                    raise ValueError(f"{self.path}: schema version {found}, this inferd reads version {version}")
        except BaseException:
            self._db.close()
            raise

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
