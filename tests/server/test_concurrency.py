"""Many clients at once, clients that leave, steps that fail."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai

from inferd.engine.runner import ModelRunner

WORDS = "river stone cloud paper lamp violin garden copper winter orange signal harbor".split()


def _prompts(n: int) -> list[str]:
    return [f"Story {i}: the {WORDS[i % len(WORDS)]} and the {WORDS[(3 * i + 1) % len(WORDS)]}" for i in range(n)]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model="smol", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join([c.choices[0].text async for c in stream if c.choices])


def test_32_concurrent_streams_each_get_their_text_alone(server, client):
    prompts = _prompts(32)
    alone = [
        client.completions.create(model="smol", prompt=p, max_tokens=24, temperature=0).choices[0].text
        for p in prompts
    ]

    async def together() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120,
            http_client=httpx.AsyncClient(limits=limits, timeout=120),
        ) as aclient:
            return await asyncio.gather(*(_stream_text(aclient, p, 24) for p in prompts))

    assert asyncio.run(asyncio.wait_for(together(), 300)) == alone
    assert len(set(alone)) > 1
    assert server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_every_block(server):
    body = {"prompt": "Count to one thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.url}/v1/completions", json=body) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks == 3:
                break
        # Leaving the block closes the connection after three chunks.
    assert chunks == 3
    assert server.wait_idle(timeout=10), "the request was not aborted"
    assert not server.state.engine.num_in_flight


def test_disconnect_before_a_non_streaming_answer_aborts_it(server):
    body = json.dumps({"prompt": "Count to one thousand:", "max_tokens": 500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        deadline = time.monotonic() + 10
        while not server.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.scheduler.running, "the request never started"
    assert server.wait_idle(timeout=10), "the request was not aborted"


def test_a_failing_step_fails_only_its_requests(server, client, http, monkeypatch):
    poison = 31337 % server.engine.model_config.vocab_size
    real = ModelRunner.execute

    def execute(self, sched):  # noqa: ANN001, ANN202
        if any(poison in s.request.prompt_token_ids for s in sched.scheduled):
            raise RuntimeError("injected failure")
        return real(self, sched)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    res = http.post("/v1/completions", json={"prompt": [1, 2, poison], "max_tokens": 4})
    assert res.status_code == 500
    err = res.json()["error"]
    assert err["type"] == "internal_error" and "injected failure" in err["message"]

    with http.stream("POST", "/v1/completions", json={"prompt": [poison, 5], "max_tokens": 4, "stream": True}) as s:
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "internal_error" and events[-1] == "[DONE]"

    ok = client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
    assert http.get("/health").status_code == 200
    assert server.wait_idle()
