"""Result files: appended whole lines, a torn tail cut off on reopening."""

from __future__ import annotations

import json

import pytest

from inferd.batch.journal import ResultFile


def test_entries_survive_reopening(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultFile(path) as f:
        f.append({"custom_id": "a"})
        f.append({"custom_id": "b", "text": "é"})
    with ResultFile(path) as f:
        assert f.entries == [{"custom_id": "a"}, {"custom_id": "b"}]  # keys only, not bodies
        f.append({"custom_id": "c", "line": 3})
        assert f.entries[-1] == {"custom_id": "c", "line": 3}
    assert [json.loads(line)["custom_id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]


def test_a_torn_last_line_is_cut_off(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    with ResultFile(path) as f:
        assert [e["custom_id"] for e in f.entries] == ["a", "b"]
        f.append({"custom_id": "c"})
    assert path.read_bytes() == b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id":"c"}\n'


def test_a_file_that_is_not_jsonl_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="not JSON"):
        ResultFile(path)
