"""Pure ASGI middleware (no ``BaseHTTPMiddleware``: it would buffer streams
and hide client disconnects from the routes)."""

from __future__ import annotations

import json
import re
import uuid

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
_VALID_ID = re.compile(r"^[\w.:\-]{1,128}$")


class RequestContextMiddleware:
    """Gives every request an id (the client's ``X-Request-Id`` when it is
    sane, else a fresh one), echoed in the response header, and refuses a
    body over ``max_body_bytes`` with 413 before any route parses it.
    ``upload_limits`` gives ``POST`` paths a limit of their own (file uploads)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, upload_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.upload_limits = dict(upload_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = given if _VALID_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        limit = self.max_body_bytes
        if scope["method"] == "POST":
            limit = self.upload_limits.get(scope["path"], limit)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send_with_id, limit)
            return
        # Read the whole body (bounded) so a chunked upload is held to the
        # same limit, then replay it to the app.
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await self._too_large(send_with_id, limit)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_id)

    @staticmethod
    async def _too_large(send: Send, limit: int) -> None:
        payload = json.dumps(
            {
                "error": {
                    "message": f"request body is larger than the limit of {limit} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
