"""A misbehaving OpenAI-compatible server on loopback: raw asyncio, one behaviour per path prefix.

``{url}/{behaviour}`` is the base URL a bench run gets, so the bench's
``/v1/completions`` arrives as ``/{behaviour}/v1/completions``.
"""

from __future__ import annotations

import asyncio
import json
import threading

CHUNK_GAP_S = 0.02


def _event(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {data}\n\n".encode()


def _text(text: str) -> bytes:
    return _event({"object": "text_completion", "choices": [{"index": 0, "text": text}]})


def _usage(prompt: int, completion: int) -> bytes:
    return _event({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


SSE_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class FakeServer:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self.loop.run_forever()

    def start(self) -> FakeServer:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next((int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                if not await self._route(path, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _route(self, path: str, w: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        behaviour, _, rest = path.lstrip("/").partition("/")
        if rest == "v1/models":
            body = json.dumps({"object": "list", "data": [{"id": f"fake-{behaviour}"}]}).encode()
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            await w.drain()
            return True
        if rest == "tokenize":
            w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await w.drain()
            return True
        if behaviour == "http500":
            body = b'{"error": {"message": "boom", "type": "internal_error"}}'
            w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
            await w.drain()
            return True
        if behaviour == "stall_headers":
            await asyncio.sleep(3600)
        w.write(SSE_HEADERS)
        if behaviour == "stall":
            w.write(_chunked(_text("a")))
            await w.drain()
            await asyncio.sleep(3600)
        if behaviour in ("ok", "nousage"):
            for word in ("a", " b", " c", " d"):
                w.write(_chunked(_text(word)))
                await w.drain()
                await asyncio.sleep(CHUNK_GAP_S)
            if behaviour == "ok":
                w.write(_chunked(_usage(7, 4)))
            w.write(_chunked(_event("[DONE]")) + b"0\r\n\r\n")
            await w.drain()
            return True
        if behaviour == "error_event":
            w.write(_chunked(_text("a")) + _chunked(_event({"error": {"message": "engine step failed"}})))
            w.write(_chunked(_event("[DONE]")) + b"0\r\n\r\n")
            await w.drain()
            return True
        if behaviour == "drop":
            w.write(_chunked(_text("a")))
            await w.drain()
            w.transport.abort()
            return False
        if behaviour == "incomplete":  # a well-formed body that just ends
            w.write(_chunked(_text("a")) + b"0\r\n\r\n")
            await w.drain()
            return True
        if behaviour == "garbage":
            w.write(_chunked(b"data: {not json\n\n") + b"0\r\n\r\n")
            await w.drain()
            return True
        raise AssertionError(f"no behaviour {behaviour!r}")
