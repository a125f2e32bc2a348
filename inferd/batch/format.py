"""The OpenAI batch file format: input lines in, result and error lines out.

Input, one JSON object per line::

    {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one per request, in the order they finish::

    {"id": "batch_req_...", "custom_id": "a1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A line that cannot run (bad JSON, unknown url, a body the endpoint refuses,
a repeated custom_id) becomes an error line with ``response: null`` and
``error: {"code", "message"}``, plus the input ``line`` number, so a resumed
run knows it was answered.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from inferd.server.protocol import ChatCompletionRequest, CompletionRequest

# url -> the request model its body must satisfy.
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
# Accepted by OpenAI's format, not served by inferd yet: a clear error per line.
UNSUPPORTED_ENDPOINTS = {"/v1/embeddings": "embeddings are not served yet"}
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    request: BaseModel  # the validated body

    @property
    def body(self) -> dict[str, Any]:
        return self.request.model_dump(exclude_unset=True)


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


def parse_line(text: str, line: int) -> BatchLine | LineError:
    """One input line, validated as far as the edge would (schema, stream off)."""
    try:
        entry = json.loads(text)
    except ValueError as e:
        return LineError(line, None, "invalid_json", f"line {line} is not valid JSON: {e}")
    if not isinstance(entry, dict):
        return LineError(line, None, "invalid_request", f"line {line} must be a JSON object")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError(line, None, "invalid_custom_id", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters")
    if entry.get("method", "POST") != "POST":
        return LineError(line, custom_id, "invalid_method", f"method must be POST, got {entry.get('method')!r}")
    url = entry.get("url")
    if url in UNSUPPORTED_ENDPOINTS:
        return LineError(line, custom_id, "unsupported_url", f"url {url}: {UNSUPPORTED_ENDPOINTS[url]}")
    if url not in ENDPOINTS:
        return LineError(line, custom_id, "invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = entry.get("body")
    if not isinstance(body, dict):
        return LineError(line, custom_id, "invalid_body", "body must be a JSON object")
    try:
        request = ENDPOINTS[url].model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return LineError(line, custom_id, "invalid_body", f"body.{where}: {first['msg']}")
    if getattr(request, "stream", False):
        return LineError(line, custom_id, "invalid_body", "body.stream: streaming is not available in a batch")
    return BatchLine(line, custom_id, url, request)


def result_line(custom_id: str, status_code: int, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(error: LineError) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
        "line": error.line,
    }
