"""Append-only JSONL result files that survive a crash mid-run.

The output file is its own checkpoint: every result is one ``write`` of a
whole line to a file opened for appending, flushed to disk (``fsync``) at
most ``sync_interval_s`` apart and on close. Reopened after a crash, a torn
last line (a write the crash cut) is cut off, and the lines before it say
which requests are answered, so a rerun skips exactly those: each answered
request appears once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class ResultFile:
    def __init__(self, path: str | Path, sync_interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.sync_interval_s = sync_interval_s
        # What each line answers: its custom_id and input line (not the
        # response bodies: a long run's output need not fit in memory).
        self.entries: list[dict[str, Any]] = self._recover()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_sync = time.monotonic()
        self._dirty = False

    def _recover(self) -> list[dict[str, Any]]:
        """The whole lines already in the file; a torn tail is truncated."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        entries = []
        for raw in data[:end].splitlines():
            if raw.strip():
                try:
                    entries.append(_key(json.loads(raw)))
                except ValueError:
                    raise ValueError(f"{self.path}: a line is not JSON; is this a batch result file?") from None
        return entries

    def append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        written = os.write(self._fd, line)
        if written != len(line):  # a full disk: leave no torn line behind us
            raise OSError(f"{self.path}: short write ({written} of {len(line)} bytes)")
        self._dirty = True
        self.entries.append(_key(entry))
        if time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: entry[k] for k in ("custom_id", "line") if k in entry}
