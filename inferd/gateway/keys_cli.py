"""``inferd keys create|list|revoke``: manage the gateway's API keys (stdlib only: cheap to import)."""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from inferd.gateway.keys import KeyRecord, KeyStore, default_data_dir, iso_utc

_UNITS = {"d": 86400, "h": 3600, "m": 60}
_RELATIVE = re.compile(r"(\d+)([dhm])")


def parse_expires(text: str, now: float) -> float:
    """``30d`` / ``12h`` / ``90m`` from now, or an ISO date or datetime (UTC unless it names a zone)."""
    m = _RELATIVE.fullmatch(text.strip())
    if m:
        ts = now + int(m.group(1)) * _UNITS[m.group(2)]
    else:
        iso = text.strip()
        # Python 3.10's fromisoformat does not read a trailing Z.
        iso = iso[:-1] + "+00:00" if iso.endswith(("Z", "z")) else iso
        try:
            when = datetime.fromisoformat(iso)
        except ValueError:
            raise ValueError(f"--expires: expected 30d, 12h, 90m or a date like 2027-01-31 or 2027-01-31T12:00:00Z, got {text!r}") from None
        ts = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if ts <= now:
        raise ValueError(f"--expires {text!r} is not in the future ({iso_utc(ts)}, now {iso_utc(now)})")
    return ts


def _data_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="where gateway.db lives (default: $INFERD_HOME, else ~/.inferd)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)

    create = sub.add_parser("create", help="create a key and print it (shown only this once)")
    create.add_argument("--name", required=True, help="a label, unique among active keys")
    create.add_argument("--models", default=None, help="comma-separated models the key may use (default: every model)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: the gateway's)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: the gateway's)")
    create.add_argument("--max-concurrent", type=int, default=None, help="requests in flight (default: the gateway's)")
    create.add_argument("--expires", default=None, metavar="30d|12h|90m|DATE",
                        help="lifetime, or an ISO date/datetime, UTC unless a zone is given (default: never)")
    _data_dir_arg(create)

    ls = sub.add_parser("list", help="list every key with its limits, status and usage")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    _data_dir_arg(ls)

    revoke = sub.add_parser("revoke", help="revoke a key; requests with it get 401 from then on")
    revoke.add_argument("key", metavar="ID_OR_NAME", help="the key's id, its sk-<id>... prefix, or the name of an active key")
    _data_dir_arg(revoke)


def _create(store: KeyStore, a: argparse.Namespace) -> None:
    now = time.time()
    models = None if a.models is None else [m.strip() for m in a.models.split(",")]
    expires_at = None if a.expires is None else parse_expires(a.expires, now)
    key, record = store.create(a.name, models=models, rpm=a.rpm, tpm=a.tpm, max_concurrent=a.max_concurrent,
                               expires_at=expires_at, now=now)
    print(key, flush=True)
    print(f"created {record.prefix} ({record.name}): this is the only time the key is shown; "
          f"{store.path} keeps only its SHA-256 hash", file=sys.stderr)


def _row(store: KeyStore, r: KeyRecord, now: float) -> dict:
    usage = store.usage(r.id)
    return {
        "id": r.id,
        "prefix": r.prefix,
        "name": r.name,
        "models": None if r.models is None else list(r.models),
        "rpm": r.rpm,
        "tpm": r.tpm,
        "max_concurrent": r.max_concurrent,
        "created_at": r.created_at,
        "expires_at": r.expires_at,
        "revoked_at": r.revoked_at,
        "status": r.status(now),
        **usage,
    }


def _table(rows: list[dict]) -> str:
    def limit(v: int | None) -> str:
        return "default" if v is None else str(v)

    def when(ts: float | None) -> str:
        return "never" if ts is None else iso_utc(ts)

    header = ("ID", "NAME", "MODELS", "RPM", "TPM", "CONCURRENT", "CREATED", "EXPIRES", "STATUS", "REQUESTS", "TOKENS")
    cells = [header] + [
        (r["prefix"], r["name"], "*" if r["models"] is None else ",".join(r["models"]), limit(r["rpm"]),
         limit(r["tpm"]), limit(r["max_concurrent"]), iso_utc(r["created_at"]), when(r["expires_at"]), r["status"],
         str(r["requests"]), str(r["prompt_tokens"] + r["completion_tokens"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _list(store: KeyStore, a: argparse.Namespace) -> None:
    now = time.time()
    rows = [_row(store, r, now) for r in store.list()]
    if a.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(_table(rows))
    else:
        print(f"no keys in {store.path}; create one with: inferd keys create --name NAME", file=sys.stderr)


def _revoke(store: KeyStore, a: argparse.Namespace) -> None:
    record = store.revoke(a.key)
    print(f"revoked {record.prefix} ({record.name})")


_COMMANDS = {"create": _create, "list": _list, "revoke": _revoke}


def run(args: argparse.Namespace) -> int:
    db = Path(args.data_dir or default_data_dir()).expanduser() / "gateway.db"
    try:
        store = KeyStore(db)
    except (OSError, sqlite3.Error) as e:  # an unwritable dir or a file that is not a database
        raise ValueError(f"--data-dir: cannot open {db}: {e}") from None
    try:
        _COMMANDS[args.keys_command](store, args)
    finally:
        store.close()
    return 0
