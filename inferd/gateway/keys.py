"""The gateway's API keys: SQLite rows holding SHA-256 hashes, never the keys themselves.

A key reads ``sk-<id>-<secret>``: ``id`` is 12 lowercase hex chars, public (it
names the key in ``inferd keys list`` and in logs) and the row's primary key;
``secret`` is 32 random bytes in url-safe base64 (43 chars). Only the SHA-256
of the whole key is stored, so a leaked ``gateway.db`` leaks no usable key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from inferd.sqlite_db import Database, default_data_dir  # noqa: F401 - default_data_dir re-exported

KEY_PREFIX = "sk-"
ID_LEN = 12
SECRET_LEN = 43  # 32 bytes, url-safe base64 without padding
KEY_LEN = len(KEY_PREFIX) + ID_LEN + 1 + SECRET_LEN
SCHEMA_VERSION = 1
_HEX = frozenset("0123456789abcdef")
# Compared against when the presented key has no row, so a wrong id costs the
# same hash-and-compare as a wrong secret.
_DUMMY_HASH = hashlib.sha256(b"inferd: no such key").hexdigest()
AUTH_REASONS = ("missing", "invalid", "revoked", "expired")


def iso_utc(ts: float) -> str:
    """Unix seconds -> ``2027-01-31T12:00:00Z``."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _parse_id(presented: str) -> str | None:
    """The id of a well-formed key, else None (no regex: the format is positional)."""
    if len(presented) != KEY_LEN or not presented.startswith(KEY_PREFIX) or presented[-SECRET_LEN - 1] != "-":
        return None
    key_id = presented[len(KEY_PREFIX) : len(KEY_PREFIX) + ID_LEN]
    return key_id if _HEX.issuperset(key_id) else None


class AuthError(Exception):
    """A request's key was not accepted; ``str(e)`` is safe to show the client."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in AUTH_REASONS:
            raise ValueError(f"reason must be one of {AUTH_REASONS}, got {reason!r}")
        super().__init__(message)
        self.reason = reason


def _check_limit(field: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{field} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True)
class KeyRecord:
    id: str  # public key id, 12 lowercase hex chars, part of the key itself
    name: str
    models: tuple[str, ...] | None  # None: every model
    rpm: int | None  # requests per minute; None: the gateway's default
    tpm: int | None  # tokens per minute
    max_concurrent: int | None  # requests in flight
    created_at: float  # unix seconds
    expires_at: float | None = None
    revoked_at: float | None = None

    def __post_init__(self) -> None:
        if len(self.id) != ID_LEN or not _HEX.issuperset(self.id):
            raise ValueError(f"id must be {ID_LEN} lowercase hex chars, got {self.id!r}")
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if self.models is not None:
            if not self.models:
                raise ValueError("models must name at least one model, or be None for every model")
            for m in self.models:
                if not isinstance(m, str) or not m.strip():
                    raise ValueError(f"models must be non-empty model names, got {m!r}")
        _check_limit("rpm", self.rpm)
        _check_limit("tpm", self.tpm)
        _check_limit("max_concurrent", self.max_concurrent)

    @property
    def prefix(self) -> str:
        """What ``inferd keys list`` shows and what logs may name: ``sk-<id>...``."""
        return f"{KEY_PREFIX}{self.id}..."

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def status(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


# Statements, not one script: executescript() COMMITs first, which would end
# the transaction that creates the schema and sets user_version together.
_SCHEMA = (
    """CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    models TEXT,  -- JSON list of model names; NULL: every model
    rpm INTEGER,
    tpm INTEGER,
    max_concurrent INTEGER,
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL
)""",
    """CREATE TABLE key_usage (
    key_id TEXT PRIMARY KEY REFERENCES api_keys(id),
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    last_used_at REAL
)""",
)
_COLUMNS = "id, name, models, rpm, tpm, max_concurrent, created_at, expires_at, revoked_at"


def _record(row: tuple) -> KeyRecord:
    key_id, name, models, rpm, tpm, max_concurrent, created_at, expires_at, revoked_at = row
    return KeyRecord(
        id=key_id,
        name=name,
        models=None if models is None else tuple(json.loads(models)),
        rpm=rpm,
        tpm=tpm,
        max_concurrent=max_concurrent,
        created_at=created_at,
        expires_at=expires_at,
        revoked_at=revoked_at,
    )


class KeyStore:
    """API keys in SQLite (<data_dir>/gateway.db); keys are stored as SHA-256 hashes only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # The CLI and a running gateway share the file (see Database).
        # synchronous stays FULL: a revoke lost to a power cut would re-enable a key.
        self._db = Database(self.path, _SCHEMA, SCHEMA_VERSION, synchronous="FULL", foreign_keys=True)
        self._tx = self._db.tx
        self._query = self._db.query

    def create(
        self,
        name: str,
        models: Sequence[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrent: int | None = None,
        expires_at: float | None = None,
        now: float | None = None,
    ) -> tuple[str, KeyRecord]:
        """Return (the key, its record); the key itself is not kept and cannot be shown again."""
        now = time.time() if now is None else now
        if isinstance(models, str):  # a str is a Sequence[str] of letters
            raise ValueError(f"models must be a list of model names, got the string {models!r}")
        if expires_at is not None and expires_at <= now:
            raise ValueError(f"expires_at must be in the future, got {iso_utc(expires_at)} (now {iso_utc(now)})")
        secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
        record = KeyRecord(
            id=secrets.token_hex(ID_LEN // 2),
            name=name,
            models=None if models is None else tuple(models),
            rpm=rpm,
            tpm=tpm,
            max_concurrent=max_concurrent,
            created_at=now,
            expires_at=expires_at,
        )
        with self._tx() as db:
            if self._active_by_name(db, name, now) is not None:
                raise ValueError(f"name: an active key is already named {name!r}; revoke it or pick another name")
            while db.execute("SELECT 1 FROM api_keys WHERE id = ?", (record.id,)).fetchone():
                record = replace(record, id=secrets.token_hex(ID_LEN // 2))  # 2**-48 odds
            key = f"{KEY_PREFIX}{record.id}-{secret}"
            db.execute(
                "INSERT INTO api_keys (id, name, key_hash, models, rpm, tpm, max_concurrent, created_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.id, name, _hash(key), None if record.models is None else json.dumps(list(record.models)),
                 rpm, tpm, max_concurrent, now, expires_at),
            )
        return key, record

    @staticmethod
    def _active_by_name(db: sqlite3.Connection, name: str, now: float) -> KeyRecord | None:
        rows = db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE name = ? AND revoked_at IS NULL ORDER BY rowid",
                          (name,)).fetchall()
        # create() refuses a second active name, so at most one is active at
        # any real now; a caller-supplied past now could see two: take the newest.
        active = [r for r in map(_record, rows) if r.status(now) == "active"]
        return active[-1] if active else None

    def list(self) -> list[KeyRecord]:
        """Every key, revoked and expired included, oldest first."""
        return [_record(r) for r in self._query(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, rowid")]

    def get(self, key_id: str) -> KeyRecord | None:
        rows = self._query(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
        return _record(rows[0]) if rows else None

    def revoke(self, id_or_name: str, now: float | None = None) -> KeyRecord:
        """Revoke by id, by ``sk-<id>...`` prefix, or by the name of an active key."""
        now = time.time() if now is None else now
        key_id = id_or_name.removeprefix(KEY_PREFIX).removesuffix("...")
        with self._tx() as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)).fetchall()
            record = _record(rows[0]) if rows else self._active_by_name(db, id_or_name, now)
            if record is None:
                raise ValueError(f"no key matches {id_or_name!r}: give its id, its sk-<id>... prefix or the name of an active key")
            if record.revoked_at is not None:
                raise ValueError(f"key {record.prefix} ({record.name}) was already revoked at {iso_utc(record.revoked_at)}")
            db.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (now, record.id))
        return replace(record, revoked_at=now)

    def verify(self, presented: str | None, now: float | None = None) -> KeyRecord:
        """The record of a valid, active key; AuthError otherwise."""
        if not presented:
            raise AuthError("missing", f"missing API key: send Authorization: Bearer {KEY_PREFIX}...")
        now = time.time() if now is None else now
        key_id = _parse_id(presented)
        row = None
        if key_id is not None:
            row = self._query(f"SELECT {_COLUMNS}, key_hash FROM api_keys WHERE id = ?", (key_id,))
        stored = row[0][-1] if row else _DUMMY_HASH
        # Always one hash and one constant-time compare, whatever failed before.
        if not hmac.compare_digest(_hash(presented), stored) or not row:
            raise AuthError("invalid", "invalid API key")
        record = _record(row[0][:-1])
        status = record.status(now)
        if status == "revoked":
            raise AuthError("revoked", f"API key {record.prefix} was revoked")
        if status == "expired":
            raise AuthError("expired", f"API key {record.prefix} expired at {iso_utc(record.expires_at)}")
        return record

    def add_usage(self, key_id: str, requests: int, prompt_tokens: int, completion_tokens: int,
                  now: float | None = None) -> None:
        """Add to the key's running totals and set its last_used_at."""
        for field, value in (("requests", requests), ("prompt_tokens", prompt_tokens),
                             ("completion_tokens", completion_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
        now = time.time() if now is None else now
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO key_usage VALUES (?, ?, ?, ?, ?) ON CONFLICT(key_id) DO UPDATE SET"
                    " requests = requests + excluded.requests,"
                    " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                    " completion_tokens = completion_tokens + excluded.completion_tokens,"
                    " last_used_at = excluded.last_used_at",
                    (key_id, requests, prompt_tokens, completion_tokens, now),
                )
        except sqlite3.IntegrityError:
            raise ValueError(f"key_id: no key {key_id!r}") from None

    def usage(self, key_id: str) -> dict[str, int | float | None]:
        """``{"requests", "prompt_tokens", "completion_tokens", "last_used_at"}``; zeros for an unused key."""
        rows = self._query(
            "SELECT requests, prompt_tokens, completion_tokens, last_used_at FROM key_usage WHERE key_id = ?", (key_id,))
        requests, prompt, completion, last = rows[0] if rows else (0, 0, 0, None)
        return {"requests": requests, "prompt_tokens": prompt, "completion_tokens": completion, "last_used_at": last}

    def close(self) -> None:
        self._db.close()
