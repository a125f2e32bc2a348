"""``plan``: what a rerun still has to do, from the result files so far."""

from __future__ import annotations

import json

from inferd.batch.journal import ResultFile
from inferd.batch.runner import plan


def _line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": custom_id}})


LINES = [_line("a"), "", _line("b"), "{oops", _line("a"), _line("c")]  # line numbers 1..6


def test_a_fresh_plan_runs_every_valid_line_and_reports_the_rest(tmp_path):
    with ResultFile(tmp_path / "o") as out, ResultFile(tmp_path / "e") as err:
        left = plan(LINES, out, err)
    assert left.total == 5 and left.answered == 0  # the blank line is not a request
    assert [(t.line, t.custom_id) for t in left.todo] == [(1, "a"), (3, "b"), (6, "c")]
    assert [(e.line, e.code) for e in left.invalid] == [(4, "invalid_json"), (5, "duplicate_custom_id")]
    assert "repeats an earlier line" in left.invalid[1].message


def test_a_rerun_skips_answered_ids_and_recorded_error_lines(tmp_path):
    with ResultFile(tmp_path / "o") as out, ResultFile(tmp_path / "e") as err:
        out.append({"custom_id": "b"})
        err.append({"custom_id": None, "line": 4})
        err.append({"custom_id": "c", "line": 6})  # failed at run time: answered too
        left = plan(LINES, out, err)
    assert [t.custom_id for t in left.todo] == ["a"]
    assert [e.line for e in left.invalid] == [5]
    assert left.answered == 3
