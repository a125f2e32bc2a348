"""API-key authentication as pure ASGI middleware: it runs before any route
reads the body, so a request without a valid key is refused (401) before
anything about it is parsed, and never reaches a replica."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from inferd.gateway.keys import AuthError, KeyStore

# The rate-limit identity of every request when authentication is off.
ANONYMOUS = "anonymous"


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthMiddleware:
    """Puts the caller's ``KeyRecord`` in ``scope["state"]["api_key"]`` (None
    when ``keys`` is None: authentication off); answers 401 otherwise."""

    def __init__(self, app: ASGIApp, keys: KeyStore | None, public_paths: Collection[str],
                 on_failure: Callable[[str], None] = lambda reason: None) -> None:
        self.app = app
        self.keys = keys
        self.public_paths = frozenset(public_paths)
        self.on_failure = on_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["api_key"] = None
        if self.keys is None or scope["path"] in self.public_paths or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        try:
            state["api_key"] = self.keys.verify(bearer_token(scope))
        except AuthError as e:
            self.on_failure(e.reason)
            await _unauthorized(send, e)
            return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, error: AuthError) -> None:
    payload = json.dumps(
        {"error": {"message": str(error), "type": "authentication_error", "param": None, "code": f"{error.reason}_api_key"}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"www-authenticate", b'Bearer realm="inferd"'),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
