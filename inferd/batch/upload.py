"""Checking an uploaded batch input file while it is copied to disk."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

MAX_BATCH_LINES = 50_000  # OpenAI's limit of requests per batch file


class InvalidFile(ValueError):
    """An upload that is not a batch input file (the message says why)."""


class FileTooLarge(ValueError):
    pass


def copy_batch_input(src: IO[bytes], dst: Path, max_bytes: int, max_lines: int = MAX_BATCH_LINES) -> int:
    """Copies an upload to ``dst`` while checking it is JSONL of objects, at
    most ``max_bytes`` and ``max_lines`` requests; returns its size. The
    request schema itself is checked per line when the batch runs."""
    size = requests = number = 0
    tail = b""
    with open(dst, "wb") as out:
        while chunk := src.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                raise FileTooLarge(f"file is larger than the limit of {max_bytes} bytes")
            out.write(chunk)
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for raw in lines:
                number += 1
                requests += _check_line(raw, number)
                if requests > max_lines:
                    raise InvalidFile(f"file has more than {max_lines} requests, the limit of a batch")
        if tail:
            requests += _check_line(tail, number + 1)
        out.flush()
        os.fsync(out.fileno())
    if requests == 0:
        raise InvalidFile("file holds no requests: expected one JSON object per line")
    return size


def _check_line(raw: bytes, number: int) -> int:
    if not raw.strip():
        return 0
    try:
        entry = json.loads(raw)
    except ValueError:
        raise InvalidFile(f"line {number} is not valid JSON: a batch file holds one JSON object per line") from None
    if not isinstance(entry, dict):
        raise InvalidFile(f"line {number} is not a JSON object")
    return 1
