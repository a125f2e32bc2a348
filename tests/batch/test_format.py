"""The batch file format: each kind of bad line becomes a clear error."""

from __future__ import annotations

import json

import pytest

from inferd.batch.format import BatchLine, LineError, error_line, parse_line, result_line

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _line(**fields) -> str:  # noqa: ANN003
    entry = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT} | fields
    return json.dumps(entry)


def test_a_valid_chat_line():
    parsed = parse_line(_line(), 3)
    assert isinstance(parsed, BatchLine)
    assert (parsed.line, parsed.custom_id, parsed.url) == (3, "a", "/v1/chat/completions")
    assert parsed.body == CHAT


def test_a_valid_completion_line_without_method():
    parsed = parse_line(json.dumps({"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x"}}), 1)
    assert isinstance(parsed, BatchLine) and parsed.body == {"prompt": "x"}


@pytest.mark.parametrize(
    ("text", "code", "words"),
    [
        ("{not json", "invalid_json", "line 7 is not valid JSON"),
        ("[1, 2]", "invalid_request", "must be a JSON object"),
        (_line(custom_id=""), "invalid_custom_id", "custom_id must be a non-empty string"),
        (_line(custom_id=5), "invalid_custom_id", "custom_id"),
        (_line(method="GET"), "invalid_method", "method must be POST"),
        (_line(url="/v1/images"), "invalid_url", "url must be one of /v1/chat/completions, /v1/completions"),
        (_line(url="/v1/embeddings"), "unsupported_url", "embeddings are not served yet"),
        (_line(body="hi"), "invalid_body", "body must be a JSON object"),
        (_line(body={"messages": "hi"}), "invalid_body", "body.messages"),
        (_line(body=CHAT | {"temperature": 9}), "invalid_body", "body.temperature"),
        (_line(body=CHAT | {"stream": True}), "invalid_body", "streaming is not available in a batch"),
    ],
)
def test_bad_lines_become_errors_naming_what_is_wrong(text, code, words):
    parsed = parse_line(text, 7)
    assert isinstance(parsed, LineError)
    assert parsed.line == 7 and parsed.code == code
    assert words in parsed.message


def test_result_and_error_lines_have_openai_shape():
    ok = result_line("a", 200, "req-1", {"choices": []})
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"choices": []}}
    bad = error_line(LineError(4, "b", "invalid_url", "url must be ..."))
    assert bad["response"] is None and bad["custom_id"] == "b" and bad["line"] == 4
    assert bad["error"] == {"code": "invalid_url", "message": "url must be ..."}
