import hashlib
import sqlite3
import threading
from pathlib import Path

import pytest

from inferd.gateway.keys import AuthError, KeyRecord, KeyStore, default_data_dir, iso_utc

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


@pytest.fixture
def store(tmp_path):
    s = KeyStore(tmp_path / "gateway.db")
    yield s
    s.close()


def auth_error(store: KeyStore, presented: str | None, now: float = T0) -> AuthError:
    with pytest.raises(AuthError) as e:
        store.verify(presented, now=now)
    return e.value


def test_default_data_dir_reads_inferd_home_at_call_time():
    assert default_data_dir({"INFERD_HOME": "/srv/inferd"}) == Path("/srv/inferd")
    assert default_data_dir({}) == Path.home() / ".inferd"
    assert default_data_dir({"INFERD_HOME": ""}) == Path.home() / ".inferd"


def test_key_format_and_round_trip(store):
    key, rec = store.create("ci", now=T0)
    assert key.startswith(f"sk-{rec.id}-") and len(key) == 59
    assert len(rec.id) == 12 and set(rec.id) <= set("0123456789abcdef")
    assert len(key.split("-", 2)[2]) == 43 and "=" not in key
    assert rec.prefix == f"sk-{rec.id}..."
    assert rec == KeyRecord(id=rec.id, name="ci", models=None, rpm=None, tpm=None, max_concurrent=None,
                            created_at=T0, expires_at=None, revoked_at=None)
    assert store.verify(key, now=T0 + 1) == rec
    assert store.get(rec.id) == rec
    assert store.get("000000000000") is None


def test_two_keys_differ(store):
    a, ra = store.create("a", now=T0)
    b, rb = store.create("b", now=T0)
    assert a != b and ra.id != rb.id


def test_missing_key(store):
    for presented in (None, ""):
        e = auth_error(store, presented)
        assert e.reason == "missing"
        assert str(e) == "missing API key: send Authorization: Bearer sk-..."


def test_invalid_keys_all_read_the_same(store):
    key, rec = store.create("ci", now=T0)
    wrong_secret = key[:-1] + ("A" if key[-1] != "A" else "B")
    unknown_id = "sk-" + ("0" * 12 if rec.id != "0" * 12 else "1" * 12) + key[15:]
    for presented in ("nonsense", key + "x", key[:-1], key.upper(), "Bearer " + key, wrong_secret, unknown_id,
                      "sk-" + "g" * 12 + key[15:]):
        e = auth_error(store, presented)
        assert (e.reason, str(e)) == ("invalid", "invalid API key"), presented


def test_revoked_key(store):
    key, rec = store.create("ci", now=T0)
    revoked = store.revoke(rec.id, now=T0 + 10)
    assert revoked.revoked_at == T0 + 10 and revoked.status(T0 + 10) == "revoked"
    e = auth_error(store, key, now=T0 + 11)
    assert (e.reason, str(e)) == ("revoked", f"API key sk-{rec.id}... was revoked")


def test_expired_key(store):
    key, rec = store.create("ci", expires_at=T0 + 60, now=T0)
    assert store.verify(key, now=T0 + 59.9) == rec
    assert rec.status(T0 + 59.9) == "active" and rec.status(T0 + 60) == "expired"
    e = auth_error(store, key, now=T0 + 60)
    assert (e.reason, str(e)) == ("expired", f"API key sk-{rec.id}... expired at 2027-01-15T08:01:00Z")


def test_a_wrong_secret_does_not_reveal_revoked_or_expired(store):
    key, rec = store.create("ci", expires_at=T0 + 60, now=T0)
    store.revoke(rec.id, now=T0 + 1)
    assert auth_error(store, key[:-1] + ("A" if key[-1] != "A" else "B"), now=T0 + 100).reason == "invalid"


def test_auth_error_reason_is_checked():
    assert AuthError("expired", "x").reason == "expired"
    with pytest.raises(ValueError, match="reason"):
        AuthError("nope", "x")


def test_only_the_hash_is_stored(tmp_path):
    path = tmp_path / "gateway.db"
    store = KeyStore(path)
    key, rec = store.create("ci", now=T0)
    store.close()  # checkpoints the WAL into the main file
    raw = path.read_bytes()
    assert key.encode() not in raw and key.split("-", 2)[2].encode() not in raw
    assert hashlib.sha256(key.encode()).hexdigest().encode() in raw
    assert rec.id.encode() in raw


def test_models_restriction(store):
    _, only = store.create("only", models=["llama", "qwen"], now=T0)
    _, every = store.create("every", now=T0)
    assert only.models == ("llama", "qwen")
    assert only.allows("llama") and only.allows("qwen") and not only.allows("mistral")
    assert every.models is None and every.allows("mistral")
    assert store.get(only.id).models == ("llama", "qwen")


def test_limits_are_stored(store):
    key, rec = store.create("ci", rpm=60, tpm=10_000, max_concurrent=4, now=T0)
    assert (rec.rpm, rec.tpm, rec.max_concurrent) == (60, 10_000, 4)
    assert store.verify(key, now=T0) == rec


def test_revoke_by_id_prefix_and_name(store):
    _, a = store.create("a", now=T0)
    _, b = store.create("b", now=T0)
    _, c = store.create("c", now=T0)
    assert store.revoke(a.id, now=T0 + 1).id == a.id
    assert store.revoke(f"sk-{b.id}...", now=T0 + 1).id == b.id
    assert store.revoke("c", now=T0 + 1).id == c.id
    assert [r.status(T0 + 1) for r in store.list()] == ["revoked", "revoked", "revoked"]


def test_revoke_errors(store):
    _, a = store.create("a", now=T0)
    store.revoke("a", now=T0 + 1)
    with pytest.raises(ValueError, match=f"sk-{a.id}... \\(a\\) was already revoked at"):
        store.revoke(a.id, now=T0 + 2)
    with pytest.raises(ValueError, match="no key matches 'a'"):
        store.revoke("a", now=T0 + 2)  # the name of a revoked key no longer matches
    with pytest.raises(ValueError, match="no key matches 'nobody'"):
        store.revoke("nobody", now=T0 + 2)


def test_duplicate_active_name_is_rejected_until_revoked_or_expired(store):
    _, first = store.create("ci", expires_at=T0 + 60, now=T0)
    with pytest.raises(ValueError, match="^name: an active key is already named 'ci'"):
        store.create("ci", now=T0 + 1)
    _, second = store.create("ci", now=T0 + 60)  # the first has expired
    store.revoke(second.id, now=T0 + 61)
    _, third = store.create("ci", now=T0 + 62)
    assert [r.id for r in store.list()] == [first.id, second.id, third.id]
    assert store.revoke("ci", now=T0 + 63).id == third.id


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"rpm": 0}, "rpm"),
        ({"tpm": -5}, "tpm"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"rpm": 1.5}, "rpm"),
        ({"rpm": True}, "rpm"),
        ({"models": []}, "models"),
        ({"models": ["llama", ""]}, "models"),
        ({"models": "llama"}, "models"),
        ({"expires_at": T0}, "expires_at"),
        ({"expires_at": T0 - 1}, "expires_at"),
    ],
)
def test_create_validation_names_the_field(store, kwargs, field):
    args = {"name": "ci", **kwargs}
    with pytest.raises(ValueError, match=f"^{field}"):
        store.create(now=T0, **args)
    assert store.list() == []


def test_list_is_oldest_first(store):
    _, b = store.create("b", now=T0 + 5)
    _, a = store.create("a", now=T0)
    _, c = store.create("c", now=T0 + 5)
    assert [r.name for r in store.list()] == ["a", "b", "c"]


def test_usage_accumulates(store):
    _, rec = store.create("ci", now=T0)
    assert store.usage(rec.id) == {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "last_used_at": None}
    store.add_usage(rec.id, 1, 10, 20, now=T0 + 1)
    store.add_usage(rec.id, 2, 5, 7, now=T0 + 2)
    assert store.usage(rec.id) == {"requests": 3, "prompt_tokens": 15, "completion_tokens": 27, "last_used_at": T0 + 2}
    with pytest.raises(ValueError, match="^key_id"):
        store.add_usage("000000000000", 1, 1, 1)
    with pytest.raises(ValueError, match="^prompt_tokens"):
        store.add_usage(rec.id, 1, -1, 1)


def test_state_survives_reopening(tmp_path):
    path = tmp_path / "sub" / "gateway.db"  # the parent dir is created
    store = KeyStore(path)
    key, rec = store.create("ci", models=["llama"], rpm=10, expires_at=T0 + 3600, now=T0)
    _, gone = store.create("gone", now=T0)
    store.revoke("gone", now=T0 + 1)
    store.add_usage(rec.id, 4, 100, 200, now=T0 + 2)
    store.close()

    again = KeyStore(path)
    assert again.verify(key, now=T0 + 3) == rec
    assert [r.status(T0 + 3) for r in again.list()] == ["active", "revoked"]
    assert again.get(gone.id).revoked_at == T0 + 1
    assert again.usage(rec.id) == {"requests": 4, "prompt_tokens": 100, "completion_tokens": 200, "last_used_at": T0 + 2}
    again.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (1,)
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "gateway.db"
    KeyStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 2")
    with pytest.raises(ValueError, match="schema version 2"):
        KeyStore(path)


def test_created_in_one_thread_used_in_another(store):
    key, rec = store.create("ci", now=T0)
    seen = []
    t = threading.Thread(target=lambda: seen.append(store.verify(key, now=T0)))
    t.start()
    t.join()
    assert seen == [rec]


def test_iso_utc():
    assert iso_utc(T0) == "2027-01-15T08:00:00Z"
