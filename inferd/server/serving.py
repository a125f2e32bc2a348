"""Completions and chat completions: OpenAI request -> engine requests ->
OpenAI response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from inferd.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from inferd.engine.outputs import CompletionOutput, RequestOutput
from inferd.engine.scheduler import ContextLengthError
from inferd.obs.tracing import RequestTracer, RequestSpan
from inferd.sampling_params import SamplingParams
from inferd.server import errors
from inferd.server.errors import APIError
from inferd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    random_id,
)
from inferd.tokenizer import Tokenizer

request_log = logging.getLogger("inferd.requests")

_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "logprobs", "prompt", "messages",
}  # fmt: skip


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class _Job:
    """One HTTP request: one engine request per prompt."""

    kind: str  # "completion" or "chat"
    http_id: str  # the X-Request-Id
    response_id: str
    created: int
    n: int
    engine_ids: list[str] = field(default_factory=list)
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    span: RequestSpan | None = None


@dataclass
class EventStream:
    """A streaming answer: its SSE events, and ``close`` to run however the
    response ends, even when it never started (the client left first)."""

    events: AsyncIterator[str]
    close: Callable[[], Awaitable[None]]


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        max_waiting_requests: int,
        is_draining: Callable[[], bool],
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.engine.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.is_draining = is_draining
        self.tracer = tracer
        self.system_fingerprint = f"inferd-{engine.engine.dtype}".replace("torch.", "")
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)

    # Admission ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _check_response_format(request: CompletionRequest | ChatCompletionRequest) -> None:
        fmt = request.response_format
        if fmt is not None and fmt.type != "text":
            raise errors.bad_request(f"response_format {fmt.type!r} is not supported yet; use 'text'", param="response_format")

    def check_admission(self) -> None:
        if self.is_draining():
            raise errors.unavailable("server is shutting down", retry_after_s=5)
        if not self.engine.is_running:
            raise errors.unavailable("engine is not running", retry_after_s=5)
        if self.engine.num_waiting >= self.max_waiting_requests:
            raise errors.unavailable(
                f"server is overloaded: {self.engine.num_waiting} requests waiting "
                f"(limit {self.max_waiting_requests})",
                retry_after_s=1,
            )

    def _params(self, request: CompletionRequest | ChatCompletionRequest, max_tokens, logprobs) -> SamplingParams:  # noqa: ANN001
        try:
            return request.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise errors.from_value_error(e, _SAMPLING_FIELDS) from None

    async def _submit(
        self, job: _Job, prompts: list[str | list[int]], params: SamplingParams, param_name: str, priority: int = 0
    ) -> None:
        """One engine request per prompt; on failure the caller's ``_end``
        aborts those already added."""
        try:
            for i, prompt in enumerate(prompts):
                engine_id = job.http_id if len(prompts) == 1 else f"{job.http_id}-{i}"
                # Two HTTP requests may carry the same X-Request-Id.
                if self.engine.has_request(engine_id):
                    engine_id = f"{engine_id}-{random_id('r')}"
                job.streams.append(await self.engine.add_request(engine_id, prompt, params, priority))
                job.engine_ids.append(engine_id)
        except ContextLengthError as e:
            raise errors.bad_request(str(e), param=param_name, code="context_length_exceeded") from None
        except ValueError as e:
            raise errors.from_value_error(e, _SAMPLING_FIELDS) from None
        except EngineDeadError as e:
            raise errors.unavailable(str(e)) from None

    @staticmethod
    async def _close(streams: list[AsyncIterator[RequestOutput]]) -> None:
        for s in streams:
            await s.aclose()

    def _start(self, kind: str, http_id: str, n: int, operation: str, fields: dict, headers: Mapping[str, str]) -> _Job:
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        job = _Job(kind, http_id, random_id(prefix), int(time.time()), n)
        if self.tracer is not None:
            job.span = self.tracer.start(operation, self.model_name, fields, headers)
        return job

    async def _end(self, job: _Job, error: str | None = None) -> None:
        """Frees what the job holds in the engine and ends its span; idempotent."""
        await self._close(job.streams)
        if job.span is not None:
            job.span.finish(job.response_id, list(job.finals.values()), error)

    async def _run(self, job: _Job, submit: Awaitable[None], stream: AsyncIterator[str] | None) -> EventStream | list[RequestOutput]:
        """Submits the job; then either its event stream or, collected, its
        final outputs. Whatever fails on the way ends the job."""
        try:
            await submit
            if stream is not None:
                return EventStream(stream, lambda: self._end(job))
            finals = await self._collect(job)
        except BaseException as e:  # including cancellation: the client left
            await self._end(job, error=str(e) or type(e).__name__)
            if stream is not None:
                await stream.aclose()
            raise
        await self._end(job)
        return finals

    # Completions ------------------------------------------------------------------

    async def create_completion(
        self, request: CompletionRequest, http_id: str, headers: Mapping[str, str] | None = None, priority: int = 0
    ) -> dict | EventStream:
        self.check_model(request.model)
        self._check_response_format(request)
        if request.suffix:
            raise errors.bad_request("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise errors.bad_request("best_of other than n is not supported", param="best_of")
        if request.echo and request.logprobs is not None:
            raise errors.bad_request("echo with logprobs is not supported yet", param="echo")
        try:
            prompts = request.prompts()
        except ValueError as e:
            raise errors.bad_request(str(e), param="prompt") from None
        params = self._params(request, request.max_tokens, request.logprobs)
        self.check_admission()
        fields = {"max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                  "top_k": request.top_k, "seed": request.seed}  # fmt: skip
        job = self._start("completion", http_id, request.n, "text_completion", fields, headers or {})
        stream = None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._completion_stream(job, request, include_usage)
        result = await self._run(job, self._submit(job, prompts, params, "prompt", priority), stream)
        if isinstance(result, EventStream):
            return result
        finals = result
        choices = []
        for p, final in enumerate(finals):
            echo = (final.prompt or self.tokenizer.decode(final.prompt_token_ids)) if request.echo else ""
            for out in final.outputs:
                choices.append(
                    {
                        "index": p * job.n + out.index,
                        "text": echo + out.text,
                        "logprobs": self._completion_logprobs(out, 0, len(echo)) if request.logprobs is not None else None,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                )
        return {
            "id": job.response_id,
            "object": "text_completion",
            "created": job.created,
            "model": self.model_name,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            "usage": self._usage(finals),
        }

    async def _completion_stream(
        self, job: _Job, request: CompletionRequest, include_usage: bool
    ) -> AsyncIterator[str]:
        sent_logprobs: dict[int, int] = {}
        text_offset: dict[int, int] = {}

        def choices(p: int, out: RequestOutput) -> list[dict]:
            result = []
            for c in out.outputs:
                index = p * job.n + c.index
                text = c.text_delta
                if request.echo and index not in text_offset:
                    text = (out.prompt or self.tokenizer.decode(out.prompt_token_ids)) + text
                if not (text or c.new_token_ids or c.finish_reason):
                    continue
                logprobs = None
                if request.logprobs is not None:
                    start = sent_logprobs.get(index, 0)
                    logprobs = self._completion_logprobs(c, start, text_offset.get(index, 0))
                    sent_logprobs[index] = len(c.logprobs or [])
                text_offset[index] = text_offset.get(index, 0) + len(text)
                result.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            return result

        async for event in self._stream(job, "text_completion", choices, [], include_usage):
            yield event

    def _completion_logprobs(self, out: CompletionOutput, start: int, offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        entries = (out.logprobs or [])[start:]
        ids = out.token_ids[start : start + len(entries)]
        for token_id, (logprob, alternatives) in zip(ids, entries):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append({self._token_text(t): lp for t, lp in alternatives} if alternatives else {text: logprob})
            offsets.append(offset)
            offset += len(text)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    # Chat -------------------------------------------------------------------------

    def render_chat(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tools=request.tools, **kwargs
            )
        except ValueError as e:
            raise errors.bad_request(str(e), param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, http_id: str, headers: Mapping[str, str] | None = None, priority: int = 0
    ) -> dict | EventStream:
        self.check_model(request.model)
        self._check_response_format(request)
        if request.tool_choice not in (None, "none", "auto"):
            raise errors.bad_request("tool_choice other than 'none' or 'auto' is not supported", param="tool_choice")
        if request.continue_final_message:
            raise errors.bad_request("continue_final_message is not supported yet", param="continue_final_message")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._params(request, request.resolved_max_tokens(), logprobs)
        prompt_ids = self.render_chat(request)
        self.check_admission()
        fields = {"max_tokens": request.resolved_max_tokens(), "temperature": request.temperature,
                  "top_p": request.top_p, "top_k": request.top_k, "seed": request.seed}  # fmt: skip
        job = self._start("chat", http_id, request.n, "chat", fields, headers or {})
        stream = None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._chat_stream(job, request, include_usage)
        result = await self._run(job, self._submit(job, [prompt_ids], params, "messages", priority), stream)
        if isinstance(result, EventStream):
            return result
        (final,) = result
        choices = [
            {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": self._chat_logprobs(out, 0)} if request.logprobs else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            for out in final.outputs
        ]
        return {
            "id": job.response_id,
            "object": "chat.completion",
            "created": job.created,
            "model": self.model_name,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            "usage": self._usage([final]),
        }

    async def _chat_stream(
        self, job: _Job, request: ChatCompletionRequest, include_usage: bool
    ) -> AsyncIterator[str]:
        sent_logprobs: dict[int, int] = {}

        def choices(_: int, out: RequestOutput) -> list[dict]:
            result = []
            for c in out.outputs:
                if not (c.text_delta or c.new_token_ids or c.finish_reason):
                    continue
                logprobs = None
                if request.logprobs:
                    start = sent_logprobs.get(c.index, 0)
                    logprobs = {"content": self._chat_logprobs(c, start)}
                    sent_logprobs[c.index] = len(c.logprobs or [])
                result.append(
                    {
                        "index": c.index,
                        "delta": {"content": c.text_delta} if c.text_delta or not c.finish_reason else {},
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            return result

        # The role comes first, in a chunk of its own for every choice.
        roles = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(job.n)
        ]
        async for event in self._stream(job, "chat.completion.chunk", choices, roles, include_usage):
            yield event

    async def _stream(
        self,
        job: _Job,
        obj: str,
        choices: Callable[[int, RequestOutput], list[dict]],
        first: list[dict],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """The SSE events of a job: ``first`` choices (if any), a chunk per
        engine output that changed something, the usage chunk when asked, and
        ``[DONE]``; a failure mid-stream is an error event before ``[DONE]``."""
        merged = self._merged(job, job.streams)
        error = None
        try:
            if first:
                yield sse(self._chunk(job, obj, first, include_usage))
            try:
                async for p, out in merged:
                    if out.error is not None:
                        raise errors.internal_error(f"request failed in the engine: {out.error}")
                    changed = choices(p, out)
                    if changed:
                        yield sse(self._chunk(job, obj, changed, include_usage))
            except APIError as e:
                error = e.message
                yield sse(e.body())
            except EngineDeadError as e:
                error = str(e)
                yield sse(errors.internal_error(error).body())
            except RequestAbortedError as e:
                error = str(e)
                yield sse(errors.unavailable(error).body())
            else:
                if include_usage:
                    usage = self._usage(list(job.finals.values()))
                    yield sse(self._chunk(job, obj, [], False, usage))
            yield sse("[DONE]")
        except BaseException as e:  # the client left: GeneratorExit or cancellation
            error = error or f"client disconnected ({type(e).__name__})"
            raise
        finally:
            await merged.aclose()
            await self._end(job, error)

    def _chat_logprobs(self, out: CompletionOutput, start: int) -> list[dict]:
        content = []
        entries = (out.logprobs or [])[start:]
        ids = out.token_ids[start : start + len(entries)]
        for token_id, (logprob, alternatives) in zip(ids, entries):
            text = self._token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": (t := self._token_text(a)), "logprob": lp, "bytes": list(t.encode())}
                        for a, lp in alternatives
                    ],
                }
            )
        return content

    # Shared -----------------------------------------------------------------------

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chunk(
        self, job: _Job, obj: str, choices: list, include_usage: bool, usage: dict | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": job.response_id,
            "object": obj,
            "created": job.created,
            "model": self.model_name,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }
        if include_usage or usage is not None:
            chunk["usage"] = usage
        return chunk

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(f.num_generated_tokens for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _merged(self, job: _Job, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all of a job's engine requests as they come."""
        if len(streams) == 1:
            async for out in streams[0]:
                self._record(job, out)
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(p: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await merged.put((p, out))
            except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
                await merged.put((p, e))
            finally:
                await merged.put((p, done))

        tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                p, item = await merged.get()
                if item is done:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._record(job, item)
                yield p, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, job: _Job, out: RequestOutput) -> None:
        if out.finished:
            job.finals[out.request_id] = out
            log_finished(out, self.model_name)

    async def _collect(self, job: _Job) -> list[RequestOutput]:
        try:
            async for _ in self._merged(job, job.streams):
                pass
        except EngineDeadError as e:
            raise errors.internal_error(str(e)) from None
        except RequestAbortedError as e:
            raise errors.unavailable(str(e)) from None
        finals = [job.finals[i] for i in job.engine_ids]
        failed = next((f for f in finals if f.error is not None), None)
        if failed is not None:
            raise errors.internal_error(f"request failed in the engine: {failed.error}")
        return finals


def log_finished(out: RequestOutput, model: str) -> None:
    m = out.metrics
    end = m.finish_time or time.time()
    reasons = sorted({c.finish_reason or "unknown" for c in out.outputs})
    fields = {
        "request_id": out.request_id,
        "model": model,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": out.num_generated_tokens,
        "queue_s": round(m.first_scheduled_time - m.arrival_time, 4) if m.first_scheduled_time else None,
        "ttft_s": round(m.time_to_first_token, 4) if m.time_to_first_token is not None else None,
        "total_s": round(end - m.arrival_time, 4),
        "finish_reason": ",".join(reasons),
    }
    request_log.info(
        " ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields}
    )
