"""The server through the official openai client, against the offline engine."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from inferd import SamplingParams

PROMPT = "The three primary colors are"


def _offline(llm, prompt, **kw) -> str:  # noqa: ANN001
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["smol"]
    assert models[0].max_model_len == server.engine.max_model_len


def test_greedy_completion_is_the_offline_engines_text(client, llm):
    expected = _offline(llm, PROMPT, temperature=0.0, max_tokens=20)
    res = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0)
    assert res.object == "text_completion"
    assert res.id.startswith("cmpl-") and res.model == "smol" and res.system_fingerprint
    assert res.choices[0].text == expected
    assert res.choices[0].finish_reason == "length"
    assert res.usage.completion_tokens == 20
    assert res.usage.total_tokens == res.usage.prompt_tokens + 20


def test_streamed_completion_adds_up_and_reports_usage(client):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_and_its_stream_agree(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    res = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0)
    assert res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected

    stream = list(
        client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0, stream=True)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == stream[0].id for c in stream)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_content_as_text_parts_and_max_completion_tokens(client):
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]
    res = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": parts}], max_completion_tokens=5, temperature=0
    )
    assert res.usage.completion_tokens <= 5


def test_n_two_seeded_samples_are_distinct_and_reproducible(client):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=16, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert first.usage.completion_tokens == 32

    other = client.completions.create(**(kw | {"seed": 99}))
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = full.split()[2]  # a word from the middle of the greedy text
    res = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    choice = res.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text and full.startswith(choice.text)


def test_completion_logprobs_rank_the_greedy_token_first(client):
    res = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == res.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)


def test_chat_logprobs_stream_one_entry_per_token(client):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
    )
    entries, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is not None:
                entries.extend(choice.logprobs.content)
    assert len(entries) == usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode(errors="replace") == e.token


def test_prompt_lists_and_token_ids_each_get_choices(client, server):
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    res = client.completions.create(model="smol", prompt=[PROMPT, "Hello"], max_tokens=8, temperature=0, n=2)
    assert sorted(c.index for c in res.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in res.choices}
    assert by_index[0] == by_index[1] == by_text.choices[0].text
    assert res.usage.prompt_tokens == len(ids) + len(server.engine.tokenizer.encode("Hello"))

    one = client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0)
    assert one.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model="smol", prompt=[ids, ids[:3]], max_tokens=8, temperature=0)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert {c.index: c.text for c in two.choices}[0] == by_text.choices[0].text


def test_echo_prepends_the_prompt(client):
    res = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert res.choices[0].text.startswith(PROMPT) and len(res.choices[0].text) > len(PROMPT)


def test_extensions_are_accepted(client):
    res = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"13": -100}, user="u1",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 12,
                    "ignore_eos": True, "stop_token_ids": [], "include_stop_str_in_output": False},
    )
    assert res.usage.completion_tokens == 12


def test_tokenize_and_detokenize_round_trip(http, server):
    res = http.post("/tokenize", json={"prompt": PROMPT})
    assert res.status_code == 200
    body = res.json()
    assert body["tokens"] == server.engine.tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == server.engine.max_model_len
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_health_version_and_openapi(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]
    spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in spec["paths"]
    completion = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "logprobs", "echo", "top_k", "ignore_eos"} <= set(completion)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "top_logprobs", "stream_options"} <= set(chat)


def test_request_id_is_kept_or_made(http):
    res = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert res.headers["x-request-id"] == "abc-123"
    made = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert len(made.headers["x-request-id"]) == 32


def test_one_log_line_per_finished_request(http, caplog):
    with caplog.at_level(logging.INFO, logger="inferd.requests"):
        http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers={"X-Request-Id": "log-me"})
    lines = [r for r in caplog.records if r.name == "inferd.requests" and "log-me" in r.getMessage()]
    assert len(lines) == 1
    fields = lines[0].fields
    assert fields["completion_tokens"] == 3 and fields["finish_reason"] == "length" and fields["model"] == "smol"
    assert 0 <= fields["queue_s"] <= fields["ttft_s"] <= fields["total_s"]

    from inferd.obs.logs import JSONFormatter

    entry = json.loads(JSONFormatter().format(lines[0]))
    assert entry["request_id"] == "log-me" and entry["prompt_tokens"] > 0


def test_raw_sse_framing(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as res:
        assert res.headers["content-type"].startswith("text/event-stream")
        raw = "".join(res.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
