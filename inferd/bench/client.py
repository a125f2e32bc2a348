"""One streaming request against an OpenAI-compatible server, timed chunk by chunk.

SSE is parsed by hand (``data: {json}`` lines, ``data: [DONE]``) so the
timings are of the bytes as they arrive, with no client library in between.
"""

from __future__ import annotations

import json
import time

import httpx

from inferd.bench.config import ENDPOINTS
from inferd.bench.records import CONNECTION, ERROR_EVENT, INCOMPLETE, INVALID_EVENT, TIMEOUT, BenchRequest, RequestResult


class BenchError(Exception):
    """The run cannot start (e.g. the server is unreachable and no --model was given)."""


class Api:
    """Where and how to send: the request body and the text of a chunk differ per endpoint."""

    def __init__(self, base_url: str, endpoint: str, model: str) -> None:
        self.url = base_url + ENDPOINTS[endpoint]
        self.chat = endpoint == "chat"
        self.model = model

    def body(self, req: BenchRequest) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.ignore_eos:
            body["ignore_eos"] = True  # an extension (inferd, vLLM, SGLang, llama.cpp)
        if self.chat:
            body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
        else:
            if req.prompt is None:
                raise ValueError("a messages request needs --endpoint chat")
            body["prompt"] = req.prompt
        return body

    def text(self, event: dict) -> str:
        choices = event.get("choices") or []
        if not choices:
            return ""
        if self.chat:
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""


def _error_message(event: dict) -> str:
    err = event.get("error")
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


async def send(client: httpx.AsyncClient, api: Api, req: BenchRequest, t_run: float) -> RequestResult:
    """Send one request and time it; ``t_run`` is the run's start (perf_counter)."""
    result = RequestResult(input_tokens=req.input_len)
    body = api.body(req)
    t0 = time.perf_counter()
    result.start = t0 - t_run
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", api.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                return result.fail(f"http_{resp.status_code}", text)
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    return result.fail(INVALID_EVENT, data[:300])
                if not isinstance(event, dict):
                    return result.fail(INVALID_EVENT, data[:300])
                if "error" in event:
                    return result.fail(ERROR_EVENT, _error_message(event))
                if usage := event.get("usage"):
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        result.input_tokens = int(usage["prompt_tokens"])
                    result.usage_reported = True
                if api.text(event):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
            if not done:
                return result.fail(INCOMPLETE, "the stream ended without [DONE]")
    except httpx.TimeoutException as e:
        return result.fail(TIMEOUT, f"{type(e).__name__}: {e}")
    except httpx.TransportError as e:  # connect errors, resets, a body cut short
        return result.fail(CONNECTION, f"{type(e).__name__}: {e}")
    result.e2el = time.perf_counter() - t0
    if not result.usage_reported:
        result.output_tokens = chunks
    result.ok = True
    return result


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists."""
    try:
        resp = await client.get(base_url + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot list models at {base_url}/v1/models ({e}); pass --model") from None


async def count_tokens(client: httpx.AsyncClient, base_url: str, model: str, text: str) -> int | None:
    """Prompt tokens by the server's ``POST /tokenize``; None when it has none."""
    try:
        resp = await client.post(base_url + "/tokenize", json={"model": model, "prompt": text})
        if resp.status_code != 200:
            return None
        return int(resp.json()["count"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
