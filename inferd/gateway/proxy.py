"""Forwarding one request to a replica, with failover before the first byte.

A request goes to the chosen replica; if the connection fails, times out,
or the replica answers 502/503/504 (overloaded, draining, broken) before the
client has been sent anything, the replica is marked and the request tries
another one (up to ``health.retries`` more). Response headers go to the
client only with the first byte of the body, so a replica that dies between
accepting a stream and its first event is failed over too. A stream cut
after that ends with an OpenAI-shaped error event and ``[DONE]``, never a
silent truncation. Streams pass through unbuffered, chunk by chunk.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from inferd.gateway.config import HealthConfig
from inferd.gateway.metrics import GatewayMetrics
from inferd.gateway.pool import NoReplicaError, ReplicaPool
from inferd.gateway.replica import Replica
from inferd.gateway.routing import Router
from inferd.server.errors import APIError

logger = logging.getLogger("inferd.gateway")

_RETRY_STATUSES = frozenset({502, 503, 504})
# Upstream response headers the client sees (the rest describe the hop).
_PASSED_HEADERS = ("content-type", "cache-control", "retry-after")


def bad_gateway(message: str) -> APIError:
    return APIError(502, message, type="upstream_error", code="bad_gateway")


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


# A choice that carries text: "text", "content" or "reasoning_content" with a
# non-empty string value. Inside a JSON string a quote is escaped, so this
# never matches text that merely contains these words.
_TEXT_FIELD = re.compile(rb'"(?:text|content|reasoning_content)"\s*:\s*"(?!")')
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


class TokenTally:
    """Completion tokens of an SSE stream as its events pass: one per choice
    of an event that carries text (inferd sends a token per event), settled
    by the ``usage`` event when the stream has one. Events are scanned as
    bytes, not parsed: this runs for every event of every stream."""

    def __init__(self) -> None:
        self._buffer = b""
        self.counted = 0
        self.usage: dict | None = None

    @property
    def mid_event(self) -> bool:
        return bool(self._buffer.strip())

    def feed(self, chunk: bytes) -> int:
        """The tokens ``chunk`` adds to the count."""
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        before = self.counted
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            if _USAGE_OBJECT.search(event):
                try:
                    usage = json.loads(event[6:]).get("usage")
                except ValueError:
                    usage = None
                if isinstance(usage, dict):
                    self.usage = usage
            self.counted += len(_TEXT_FIELD.findall(event))
        return self.counted - before


@dataclass
class Outcome:
    """What a forwarded request cost, reported when it ends."""

    replica: Replica | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None  # the replica's own count, when it gave usage
    status: int = 0
    first_byte_s: float | None = None


@dataclass
class _Request:
    path: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool
    on_tokens: Callable[[int], None]
    on_done: Callable[[Outcome], None]
    response_headers: dict[str, str]
    start: float


class _Retry(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Proxy:
    def __init__(self, client: httpx.AsyncClient, router: Router, health: HealthConfig, metrics: GatewayMetrics,
                 cold_start_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.router = router
        self.health = health
        self.metrics = metrics
        self.cold_start_timeout_s = cold_start_timeout_s
        self.clock = clock

    async def forward(
        self,
        pool: ReplicaPool,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        stream: bool,
        affinity: str | None,
        on_tokens: Callable[[int], None],
        on_done: Callable[[Outcome], None],
        response_headers: dict[str, str],
    ) -> Response:
        """The client's response. ``on_tokens`` is called with completion
        tokens as they stream; ``on_done`` once when the request ends (for a
        stream, when the stream does), unless this is cancelled first."""
        model = pool.model.name
        request = _Request(path, body, headers, stream, on_tokens, on_done, response_headers, self.clock())
        tried: set[str] = set()
        last_error: APIError | None = None
        for attempt in range(self.health.retries + 1):
            try:
                ready = await pool.wait_routable(self.cold_start_timeout_s)
            except NoReplicaError as e:
                last_error = last_error or APIError(
                    503, str(e), type="service_unavailable", code="no_replica", headers={"Retry-After": "5"}
                )
                break
            candidates = [r for r in ready if r.id not in tried]
            if not candidates:
                break
            if attempt:
                self.metrics.retries.labels(model).inc()
            replica, decision = self.router.choose(candidates, affinity)
            self.metrics.routing.labels(model, decision).inc()
            tried.add(replica.id)
            try:
                return await self._attempt(pool, replica, request)
            except _Retry as retry:
                last_error = retry.error
        error = last_error or bad_gateway(f"no replica of {model!r} could take the request")
        on_done(Outcome(status=error.status))
        response = error.response()
        response.headers.update(response_headers)
        return response

    async def _attempt(self, pool: ReplicaPool, replica: Replica, req: _Request) -> Response:
        """The response from ``replica``, or ``_Retry`` when it failed before
        the client got anything. The replica's request count is released on
        every path but a started stream, whose relay releases it."""
        replica.begin(self.clock())
        released = False

        def release(ok: bool) -> None:
            nonlocal released
            released = True
            replica.end(self.clock(), ok, self.health)

        upstream: httpx.Response | None = None
        try:
            http_request = self.client.build_request("POST", replica.url + req.path, content=req.body, headers=req.headers)
            try:
                upstream = await self.client.send(http_request, stream=True)
            except httpx.HTTPError as e:
                release(False)
                raise _Retry(self._failed(pool, replica, e, "before a response")) from None
            if upstream.status_code in _RETRY_STATUSES:
                self.metrics.upstream_errors.labels(pool.model.name, replica.id, "status").inc()
                release(False)
                raise _Retry(bad_gateway(f"replica {replica.id} answered {upstream.status_code}"))
            chunks = upstream.aiter_raw()
            try:
                first = await anext(chunks, b"")
            except httpx.HTTPError as e:
                release(False)
                raise _Retry(self._failed(pool, replica, e, "before its first byte")) from None
            outcome = Outcome(replica=replica, status=upstream.status_code, first_byte_s=self.clock() - req.start)
            self.metrics.first_byte.labels(pool.model.name).observe(outcome.first_byte_s)
            passed = {k: v for k, v in upstream.headers.items() if k in _PASSED_HEADERS}
            passed.update(req.response_headers)
            passed["x-inferd-replica"] = replica.id
            if req.stream and upstream.status_code == 200:
                relay = _Relay(self, pool, replica, upstream, first, chunks, req, outcome)
                released, upstream = True, None  # the relay owns both now
                return RelayResponse(relay, status_code=200, headers=passed)
            try:
                content = first + b"".join([c async for c in chunks])
            except httpx.HTTPError as e:
                release(False)
                raise _Retry(self._failed(pool, replica, e, "mid-response")) from None
            release(upstream.status_code < 500)
            if upstream.status_code == 200:
                self._settle_json(content, outcome, req.on_tokens)
            req.on_done(outcome)
            return Response(content, status_code=upstream.status_code, headers=passed)
        finally:
            if upstream is not None:
                await upstream.aclose()
            if not released:  # cancelled: the client or the gateway went away
                replica.end(self.clock(), True, self.health)

    def _failed(self, pool: ReplicaPool, replica: Replica, error: httpx.HTTPError, when: str) -> APIError:
        kind = "timeout" if isinstance(error, httpx.TimeoutException) else "connect"
        self.metrics.upstream_errors.labels(pool.model.name, replica.id, kind).inc()
        if isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            pool.connection_failed(replica)
        logger.warning("replica %s failed %s: %s: %s", replica.id, when, type(error).__name__, error)
        return bad_gateway(f"replica {replica.id} failed {when} ({type(error).__name__})")

    @staticmethod
    def _settle_json(content: bytes, outcome: Outcome, on_tokens: Callable[[int], None]) -> None:
        try:
            usage = json.loads(content).get("usage") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(usage.get("completion_tokens"), int):
            outcome.completion_tokens = usage["completion_tokens"]
            on_tokens(outcome.completion_tokens)
        if isinstance(usage.get("prompt_tokens"), int):
            outcome.prompt_tokens = usage["prompt_tokens"]


class _Relay:
    """A started upstream stream, passed to the client chunk by chunk.
    ``close`` (idempotent) releases the replica and reports the outcome; the
    response calls it however it ends, even if it never iterated."""

    def __init__(self, proxy: Proxy, pool: ReplicaPool, replica: Replica, upstream: httpx.Response, first: bytes,
                 chunks: AsyncIterator[bytes], req: _Request, outcome: Outcome) -> None:
        self.proxy, self.pool, self.replica, self.upstream = proxy, pool, replica, upstream
        self.first, self.chunks, self.req, self.outcome = first, chunks, req, outcome
        self.tally = TokenTally()
        self.ok = True
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            chunk = self.first
            while chunk:
                if added := self.tally.feed(chunk):
                    self.req.on_tokens(added)
                yield chunk
                chunk = await anext(self.chunks, b"")
        except httpx.HTTPError as e:
            self.ok = False
            replica = self.replica
            self.proxy.metrics.upstream_errors.labels(self.pool.model.name, replica.id, "stream").inc()
            self.pool.connection_failed(replica)
            logger.warning("replica %s cut a stream: %s: %s", replica.id, type(e).__name__, e)
            error = bad_gateway(f"the stream from replica {replica.id} broke off ({type(e).__name__}); the answer is incomplete")
            # A partial event first gets its end, so the error event parses on its own.
            yield (b"\n\n" if self.tally.mid_event else b"") + _event(error.body()) + _event("[DONE]")
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.upstream.aclose()
        self.replica.end(self.proxy.clock(), self.ok, self.proxy.health)
        tally, outcome = self.tally, self.outcome
        outcome.completion_tokens = tally.counted
        if tally.usage is not None:
            settled = tally.usage.get("completion_tokens")
            if isinstance(settled, int) and settled > tally.counted:
                self.req.on_tokens(settled - tally.counted)
                outcome.completion_tokens = settled
            if isinstance(tally.usage.get("prompt_tokens"), int):
                outcome.prompt_tokens = tally.usage["prompt_tokens"]
        self.req.on_done(outcome)


class RelayResponse(StreamingResponse):
    """Closes its relay however the response ends (a client that leaves
    before the first chunk included), so the replica is released at once."""

    def __init__(self, relay: _Relay, **kwargs: object) -> None:
        super().__init__(relay.__aiter__(), **kwargs)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.relay.close()
