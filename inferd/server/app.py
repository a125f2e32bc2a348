"""The FastAPI app: routes, error handlers, the engine's life cycle.

The app binds at once and loads the model in the background: ``/health`` is
503 until the engine is ready, then 200 until it dies or the server drains.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

import inferd
from inferd.engine.async_engine import AsyncLLMEngine
from inferd.engine.engine import LLMEngine
from inferd.obs.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from inferd.obs.metrics import ServerMetrics
from inferd.obs.tracing import RequestTracer, otlp_tracer
from inferd.server import errors
from inferd.server.batch_routes import BatchAPI, batch_router, upload_limits
from inferd.server.errors import APIError
from inferd.server.config import ServerConfig
from inferd.server.middleware import RequestContextMiddleware
from inferd.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from inferd.server.serving import EventStream, OpenAIServing

logger = logging.getLogger(__name__)

# How often a non-streaming request checks that its client is still there.
_DISCONNECT_POLL_S = 0.25

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    500: {"model": ErrorResponse, "description": "The request failed in the engine"},
    503: {"model": ErrorResponse, "description": "Loading, overloaded or shutting down"},
}


class ServerState:
    """What the routes share: the engine once loaded, and the drain flag."""

    def __init__(self, config: ServerConfig, tracer: RequestTracer | None = None) -> None:
        self.config = config
        self.tracer = tracer
        self.engine: AsyncLLMEngine | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.batch = BatchAPI(config)

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.engine.is_running and not self.draining

    def attach(self, engine: LLMEngine, load_time_s: float | None = None) -> None:
        """Starts serving ``engine``; call on the event loop."""
        name = self.config.served_model_name or _model_name(engine)
        self.metrics = metrics = ServerMetrics(name, device_type=engine.device.type)
        scheduler, kv = engine.scheduler, engine.kv_cache
        metrics.bind_gauges(
            running=lambda: len(scheduler.running),
            waiting=lambda: len(scheduler.waiting),
            kv_usage=lambda: kv.usage,
        )
        metrics.model_load.set(engine.load_time_s if load_time_s is None else load_time_s)

        def on_step(outputs: list) -> None:
            metrics.observe_step(
                outputs,
                {
                    "preemptions": scheduler.num_preemptions,
                    "prefix_queries": scheduler.prefix_cache_queries,
                    "prefix_hits": scheduler.prefix_cache_hits,
                    "spec_drafts": scheduler.spec_num_drafts,
                    "spec_draft_tokens": scheduler.spec_num_draft_tokens,
                    "spec_accepted_tokens": scheduler.spec_num_accepted_tokens,
                },
            )

        async_engine = AsyncLLMEngine(engine, on_step=on_step)
        async_engine.start()
        self.engine = async_engine
        self.serving = OpenAIServing(
            async_engine,
            name,
            self.config.max_waiting_requests,
            is_draining=lambda: self.draining,
            tracer=self.tracer,
        )
        self.batch.attach(self.serving, engine.config.max_num_seqs)
        logger.info("serving %s as %r", engine.model_path, name)

    def require(self) -> OpenAIServing:
        if self.serving is None:
            if self.load_error is not None:
                raise errors.unavailable(f"model failed to load: {self.load_error}")
            raise errors.unavailable("the model is still loading", retry_after_s=5)
        return self.serving


def _model_name(engine: LLMEngine) -> str:
    path = Path(engine.model_path)
    return path.stem if path.is_file() else path.name


class _StreamingResponse(StreamingResponse):
    """Closes its body iterator and runs ``on_close`` however the response
    ends, so a client that disconnects mid-stream (or before the stream
    began) aborts its request at once, not at garbage collection."""

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


def create_app(
    config: ServerConfig | None = None, engine: LLMEngine | None = None, tracer: RequestTracer | None = None
) -> FastAPI:
    """The app; it loads ``config.engine`` in the background unless given a
    built ``engine``, and traces to ``config.otlp_endpoint`` unless given a
    ``tracer``."""
    config = config or ServerConfig()
    if tracer is None and config.otlp_endpoint:
        tracer = otlp_tracer(config.otlp_endpoint)
    state = ServerState(config, tracer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if engine is not None:
            state.attach(engine)
        else:

            def load() -> None:
                start = time.perf_counter()
                try:
                    built = LLMEngine(config.engine)
                except BaseException as e:  # noqa: BLE001 - reported by /health and every route
                    logger.exception("model failed to load")
                    state.load_error = e
                    return
                loop.call_soon_threadsafe(state.attach, built, time.perf_counter() - start)

            threading.Thread(target=load, name="inferd-load", daemon=True).start()
        yield
        await state.batch.close()  # before the engine: lines in flight are aborted, run again after a restart
        if state.engine is not None:
            state.engine.shutdown()
        if state.tracer is not None:
            state.tracer.shutdown()

    app = FastAPI(title="inferd", version=inferd.__version__, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=config.max_body_bytes,
        upload_limits=upload_limits(config.max_body_bytes, config.max_file_bytes),
    )
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)

    def request_id(request: Request) -> str:
        return request.scope["state"]["request_id"]

    async def respond(request: Request, work: Awaitable[dict | EventStream]) -> Response:
        """The route's work as a response; a client that leaves before a
        non-streaming answer is ready cancels the work, aborting its requests."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)  # nobody reads it
        result = task.result()
        if isinstance(result, dict):
            return JSONResponse(result)
        return _StreamingResponse(
            result.events, on_close=result.close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    )
    async def completions(body: CompletionRequest, request: Request):  # noqa: ANN202
        return await respond(request, state.require().create_completion(body, request_id(request), request.headers))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={
            **_ERRORS,
            200: {"content": {"text/event-stream": {"schema": ChatCompletionChunk.model_json_schema()}}},
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):  # noqa: ANN202
        return await respond(request, state.require().create_chat_completion(body, request_id(request), request.headers))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        serving = state.require()
        card = ModelCard(id=serving.model_name, root=state.engine.engine.model_path, max_model_len=serving.max_model_len)
        return ModelList(data=[card])

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving = state.require()
        serving.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = serving.render_chat(chat)
        else:
            ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving = state.require()
        serving.check_model(body.model)
        vocab = serving.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.bad_request(f"tokens must be in [0, {vocab}), got {bad}", param="tokens")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    app.include_router(batch_router(state.batch))

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ok"})
        if state.draining:
            reason = "shutting down"
        elif state.load_error is not None:
            reason = f"model failed to load: {state.load_error}"
        elif state.engine is not None and state.engine.dead_error is not None:
            reason = f"engine loop died: {state.engine.dead_error!r}"
        else:
            reason = "loading"
        return errors.unavailable(reason).response()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=METRICS_CONTENT_TYPE)
        return Response(state.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": inferd.__version__}

    return app
