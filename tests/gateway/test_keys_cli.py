import json
import subprocess
import sys
import time

import pytest

from inferd.gateway.keys import AuthError, KeyStore
from inferd.gateway.keys_cli import parse_expires

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def keys(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.cli", "keys", *args],
                          capture_output=True, text=True, timeout=60)


def test_parse_expires_relative_and_absolute():
    assert parse_expires("30d", NOW) == NOW + 30 * 86400
    assert parse_expires("12h", NOW) == NOW + 12 * 3600
    assert parse_expires("90m", NOW) == NOW + 90 * 60
    assert parse_expires("2027-01-31", NOW) == 1_801_353_600.0  # 00:00 UTC
    assert parse_expires("2027-01-31T12:00:00Z", NOW) == 1_801_396_800.0
    assert parse_expires("2027-01-31T12:00:00", NOW) == 1_801_396_800.0  # no zone: UTC
    assert parse_expires("2027-01-31T14:00:00+02:00", NOW) == 1_801_396_800.0


@pytest.mark.parametrize("text", ["0d", "soon", "30", "30s", "-1d", "2027-13-01", "2020-01-01", "2027-01-15T07:59:59Z"])
def test_parse_expires_rejects(text):
    with pytest.raises(ValueError, match="^--expires"):
        parse_expires(text, NOW)


def test_create_list_revoke(tmp_path):
    created = keys("create", "--name", "ci", "--models", "llama, qwen", "--rpm", "60", "--tpm", "5000",
                   "--max-concurrent", "2", "--expires", "30d", "--data-dir", str(tmp_path))
    assert created.returncode == 0, created.stderr
    key = created.stdout.splitlines()[0]
    assert created.stdout == key + "\n"
    assert "only time the key is shown" in created.stderr and str(tmp_path / "gateway.db") in created.stderr
    assert key not in created.stderr

    store = KeyStore(tmp_path / "gateway.db")
    rec = store.verify(key)
    assert (rec.name, rec.models, rec.rpm, rec.tpm, rec.max_concurrent) == ("ci", ("llama", "qwen"), 60, 5000, 2)
    assert rec.expires_at == pytest.approx(rec.created_at + 30 * 86400)
    store.add_usage(rec.id, 3, 40, 2)

    listed = keys("list", "--json", "--data-dir", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row == {
        "id": rec.id, "prefix": f"sk-{rec.id}...", "name": "ci", "models": ["llama", "qwen"], "rpm": 60, "tpm": 5000,
        "max_concurrent": 2, "created_at": rec.created_at, "expires_at": rec.expires_at, "revoked_at": None,
        "status": "active", "requests": 3, "prompt_tokens": 40, "completion_tokens": 2,
        "last_used_at": row["last_used_at"],
    }
    assert row["last_used_at"] == pytest.approx(time.time(), abs=60)
    assert "hash" not in listed.stdout and key not in listed.stdout and key.split("-", 2)[2] not in listed.stdout

    revoked = keys("revoke", "ci", "--data-dir", str(tmp_path))
    assert (revoked.returncode, revoked.stdout) == (0, f"revoked sk-{rec.id}... (ci)\n"), revoked.stderr
    with pytest.raises(AuthError) as e:
        store.verify(key)
    assert e.value.reason == "revoked"
    store.close()


def test_list_table(tmp_path):
    store = KeyStore(tmp_path / "gateway.db")
    _, rec = store.create("ci", rpm=60, now=NOW)
    store.add_usage(rec.id, 2, 10, 5)
    store.close()
    table = keys("list", "--data-dir", str(tmp_path))
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "MODELS", "RPM", "TPM", "CONCURRENT", "CREATED", "EXPIRES", "STATUS",
                              "REQUESTS", "TOKENS"]
    assert line.split() == [f"sk-{rec.id}...", "ci", "*", "60", "default", "default", "2027-01-15T08:00:00Z", "never",
                            "active", "2", "15"]


def test_bad_expires_exits_2_naming_the_flag(tmp_path):
    r = keys("create", "--name", "ci", "--expires", "soon", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("inferd: error: --expires: expected 30d, 12h, 90m or a date")
    assert "Traceback" not in r.stderr
