"""The gateway's FastAPI app: authenticate, validate, limit, route, forward.

A request's path through it: ``RequestContextMiddleware`` (request id, body
size limit) -> CORS -> ``AuthMiddleware`` (API key, 401) -> the route, whose
body FastAPI validates against the same OpenAI schema ``inferd serve`` uses
(400) -> model checks (404, 403) and caps (400) -> rate limits (429) ->
``Proxy.forward`` to a replica. The body forwarded is the client's own
bytes, re-encoded only when the gateway has to change a field (the model
name the replicas know, a capped ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST as METRICS_CONTENT_TYPE
from starlette.exceptions import HTTPException as StarletteHTTPException

import inferd
from inferd.gateway.auth import ANONYMOUS, AuthMiddleware
from inferd.gateway.config import GatewayConfig, ModelConfig
from inferd.gateway.keys import KeyRecord, KeyStore, default_data_dir
from inferd.gateway.metrics import GatewayMetrics
from inferd.gateway.pool import ReplicaPool
from inferd.gateway.proxy import Outcome, Proxy
from inferd.gateway.ratelimit import RateLimited, RateLimiter, RateLimits
from inferd.gateway.routing import Router, prefix_key
from inferd.gateway.tokens import PromptCounter, load_tokenizer
from inferd.server import errors
from inferd.server.errors import APIError
from inferd.server.middleware import RequestContextMiddleware
from inferd.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

logger = logging.getLogger("inferd.gateway")

_USAGE_FLUSH_S = 5.0
# Headers of the client's request that travel to the replica (trace context and id).
_FORWARDED = ("traceparent", "tracestate", "baggage", "user-agent")

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing, invalid, revoked or expired API key"},
    403: {"model": ErrorResponse, "description": "The key may not use this model"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Rate limit reached (see Retry-After)"},
    502: {"model": ErrorResponse, "description": "Every replica tried failed"},
    503: {"model": ErrorResponse, "description": "No replica available, or the gateway is shutting down"},
}


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class Gateway:
    """Everything the routes share."""

    def __init__(self, config: GatewayConfig, keys: KeyStore | None = None) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir) if config.data_dir else default_data_dir()
        self.keys = keys if keys is not None else (KeyStore(self.data_dir / "gateway.db") if config.auth.enabled else None)
        self.metrics = GatewayMetrics()
        self.limiter = RateLimiter()
        self.router = Router(config.routing)
        self.counters = {m.name: PromptCounter(load_tokenizer(m.tokenizer) if m.tokenizer else None) for m in config.models}
        self.client: httpx.AsyncClient | None = None
        self.pools: dict[str, ReplicaPool] = {}
        self.proxy: Proxy | None = None
        self.draining = False
        self.in_flight: dict[str, int] = defaultdict(int)
        self._usage: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self._flusher: asyncio.Task | None = None
        self.metrics.bind_replicas(self._replica_counts, lambda: list(self.in_flight.items()))

    def _replica_counts(self):  # noqa: ANN202
        for name, pool in self.pools.items():
            for state, n in pool.counts().items():
                yield name, state, n

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.upstream_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.proxy = Proxy(self.client, self.router, self.config.health, self.metrics, self.config.cold_start_timeout_s)
        log_dir = self.data_dir / "logs"
        for model in self.config.models:
            pool = ReplicaPool(model, self.config.health, self.client, self.metrics, log_dir)
            self.pools[model.name] = pool
            pool.start()
        self._flusher = asyncio.ensure_future(self._flush_usage_forever())

    async def stop(self) -> None:
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while sum(self.in_flight.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(pool.shutdown(self.config.drain_timeout_s) for pool in self.pools.values()))
        if self._flusher is not None:
            self._flusher.cancel()
        self.flush_usage()
        if self.client is not None:
            await self.client.aclose()

    # Usage is written to SQLite in batches, not once per request.
    def record_usage(self, key_id: str, prompt: int, completion: int) -> None:
        entry = self._usage[key_id]
        entry[0] += 1
        entry[1] += prompt
        entry[2] += completion

    def flush_usage(self) -> None:
        if self.keys is None:
            self._usage.clear()
            return
        pending, self._usage = self._usage, defaultdict(lambda: [0, 0, 0])
        for key_id, (requests, prompt, completion) in pending.items():
            if key_id != ANONYMOUS:
                self.keys.add_usage(key_id, requests, prompt, completion)

    async def _flush_usage_forever(self) -> None:
        while True:
            await asyncio.sleep(_USAGE_FLUSH_S)
            try:
                self.flush_usage()
            except Exception:  # noqa: BLE001 - usage must not stop the gateway
                logger.exception("writing key usage")

    # One completion request -------------------------------------------------------

    def resolve_model(self, requested: str | None, key: KeyRecord | None) -> ModelConfig:
        if requested is None:
            if len(self.config.models) > 1:
                raise errors.bad_request("model is required: this gateway serves several models", param="model")
            model = self.config.models[0]
        else:
            model = self.config.model(requested)
            if model is None:
                raise APIError(404, f"the model {requested!r} does not exist", type="not_found_error", param="model", code="model_not_found")
        if key is not None and not key.allows(model.name):
            raise APIError(403, f"this API key may not use the model {model.name!r}", type="permission_error", param="model", code="model_not_allowed")
        return model

    async def complete(self, request: Request, route: str, path: str) -> Response:
        if self.draining:
            raise errors.unavailable("the gateway is shutting down")
        raw = await request.body()
        body: dict[str, Any] = json.loads(raw)  # FastAPI validated it already
        key: KeyRecord | None = request.scope["state"].get("api_key")
        model = self.resolve_model(body.get("model"), key)
        changed = self._apply_caps(model, body)
        if body.get("model") != model.replica_model:
            body["model"], changed = model.replica_model, True
        prompt_tokens = self.counters[model.name].count(body)
        if model.max_prompt_tokens is not None and prompt_tokens > model.max_prompt_tokens:
            raise errors.bad_request(
                f"the prompt is {prompt_tokens} tokens, more than this model's limit of {model.max_prompt_tokens}",
                param="messages" if "messages" in body else "prompt", code="context_length_exceeded",
            )
        key_id = key.id if key is not None else ANONYMOUS
        limits = self.config.limits.merged(RateLimits(key.rpm, key.tpm, key.max_concurrent) if key else RateLimits())
        try:
            admission = self.limiter.admit(key_id, limits, prompt_tokens)
        except RateLimited as e:
            self.metrics.rate_limited.labels(e.reason).inc()
            raise APIError(429, e.message, type="rate_limit_error", code=f"rate_limit_{e.reason}", headers=e.headers) from None

        start = time.monotonic()
        self.in_flight[model.name] += 1
        self.metrics.tokens.labels(model.name, "prompt").inc(prompt_tokens)

        def on_tokens(n: int) -> None:
            self.limiter.charge(key_id, n)
            self.metrics.tokens.labels(model.name, "completion").inc(n)

        done = False

        def on_done(outcome: Outcome) -> None:
            nonlocal done
            if done:
                return
            done = True
            self.in_flight[model.name] -= 1
            self.limiter.release(key_id)
            if outcome.prompt_tokens is not None and outcome.prompt_tokens != prompt_tokens:
                # The replica counted the prompt itself: settle the estimate.
                self.limiter.charge(key_id, max(0, outcome.prompt_tokens - prompt_tokens))
            self.record_usage(key_id, outcome.prompt_tokens or prompt_tokens, outcome.completion_tokens)
            elapsed = time.monotonic() - start
            self.metrics.requests.labels(model.name, route, str(outcome.status)).inc()
            self.metrics.latency.labels(model.name).observe(elapsed)
            logger.info(
                "%s %s -> %s %s in %.0f ms (%d+%d tokens, key %s)", route, model.name,
                outcome.replica.id if outcome.replica else "-", outcome.status, elapsed * 1000,
                outcome.prompt_tokens or prompt_tokens, outcome.completion_tokens, key_id,
            )

        headers = {"content-type": "application/json", "x-request-id": request.scope["state"]["request_id"]}
        for name in _FORWARDED:
            if name in request.headers:
                headers[name] = request.headers[name]
        headers.setdefault("traceparent", new_traceparent())
        if model.upstream_api_key:
            headers["authorization"] = f"Bearer {model.upstream_api_key}"
        content = json.dumps(body).encode() if changed else raw
        affinity = prefix_key(body, self.config.routing.prefix_chars)
        try:
            return await self.proxy.forward(
                self.pools[model.name], path, content, headers, bool(body.get("stream")), affinity,
                on_tokens, on_done, admission.headers,
            )
        except BaseException:
            # forward() reports every ending it reaches through on_done; this
            # is a cancellation (shutdown, the client left) before that.
            on_done(Outcome(status=499))
            raise

    @staticmethod
    def _apply_caps(model: ModelConfig, body: dict[str, Any]) -> bool:
        """Holds ``max_tokens`` to the model's cap; True if the body changed."""
        if model.max_tokens is None:
            return False
        names = [n for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None]
        for name in names:
            if body[name] > model.max_tokens:
                raise errors.bad_request(f"{name} must be at most {model.max_tokens} for this model, got {body[name]}", param=name)
        if names:
            return False
        body["max_tokens"] = model.max_tokens
        return True


def create_app(config: GatewayConfig, keys: KeyStore | None = None) -> FastAPI:
    gateway = Gateway(config, keys)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="inferd gateway", version=inferd.__version__, lifespan=lifespan)
    app.state.gateway = gateway
    public = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    if config.auth.public_metrics:
        public.add("/metrics")
    # Added innermost first: the request id and body limit wrap everything.
    app.add_middleware(AuthMiddleware, keys=gateway.keys if config.auth.enabled else None, public_paths=public,
                       on_failure=lambda reason: gateway.metrics.auth_failures.labels(reason).inc())
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-request-id", "traceparent", "tracestate"],
            expose_headers=["x-request-id", "x-inferd-replica", "retry-after", "x-ratelimit-limit-requests",
                            "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                            "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"],
        )
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    @app.post("/v1/chat/completions", responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gateway.complete(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions", responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gateway.complete(request, "completions", "/v1/completions")

    @app.get("/v1/models", responses={401: _ERRORS[401]})
    async def models(request: Request) -> dict:
        key: KeyRecord | None = request.scope["state"].get("api_key")
        data = [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "inferd",
             "replicas": gateway.pools[m.name].counts() if m.name in gateway.pools else {}}
            for m in config.models
            if key is None or key.allows(m.name)
        ]
        return {"object": "list", "data": data}

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> JSONResponse:
        if gateway.draining:
            return errors.unavailable("shutting down").response()
        return JSONResponse({"status": "ok", "models": {name: pool.counts() for name, pool in gateway.pools.items()}})

    @app.get("/metrics", responses={401: _ERRORS[401]})
    async def metrics() -> Response:
        return Response(gateway.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": inferd.__version__}

    return app

