"""A scriptable OpenAI-compatible upstream on loopback, for the gateway's
failure paths that a healthy inferd replica never shows: it records the
headers it is sent, and can answer 503, cut a stream, or stall."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def _chunk(text: str) -> bytes:
    payload = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeUpstream:
    """``mode``: "ok" (4 text events, usage, [DONE]), "cut" (2 events, then
    the connection breaks), "unavailable" (503), "cut_before_body" (the
    connection breaks before any byte)."""

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.mode = "ok"
        self.healthy = True
        self.requests: list[dict] = []  # {"path", "headers", "body"} per completion request
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"} if self.healthy else {"status": "down"}, status_code=200 if self.healthy else 503)

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            body = await request.json()
            self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if self.mode == "unavailable":
                return JSONResponse({"error": {"message": "overloaded", "type": "service_unavailable"}}, status_code=503)
            if self.mode == "cut_before_body":  # headers sent, then the connection breaks

                async def nothing():  # noqa: ANN202
                    raise ConnectionResetError("cut before the body")
                    yield b""

                return StreamingResponse(nothing(), media_type="text/event-stream")
            if not body.get("stream"):
                usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
                choice = {"index": 0, "text": f"from {self.name}", "finish_reason": "length"}
                return JSONResponse({"object": "text_completion", "choices": [choice], "usage": usage})

            async def events():  # noqa: ANN202
                for i, word in enumerate(("a", " b", " c", " d")):
                    if self.mode == "cut" and i == 2:
                        raise ConnectionResetError("the replica died mid-stream")
                    yield _chunk(word)
                    await asyncio.sleep(0.01)
                usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="critical", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> FakeUpstream:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self._server.started
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
