"""Bad input over raw HTTP: each a documented status with an OpenAI error
object, and the server keeps serving."""

from __future__ import annotations

import pytest

from tests.server.conftest import MAX_MODEL_LEN

GOOD = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _error(res, status: int) -> dict:  # noqa: ANN001
    assert res.status_code == status, res.text
    body = res.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_malformed_json_is_a_400(http):
    res = http.post("/v1/completions", content=b'{"prompt": "Hi", ', headers={"content-type": "application/json"})
    err = _error(res, 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", GOOD | {"max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", GOOD | {"temperature": "hot"}, "temperature"),
        ("/v1/completions", GOOD | {"stream": "yes"}, "stream"),
        ("/v1/completions", GOOD | {"prompt": 42}, "prompt"),
        ("/v1/completions", GOOD | {"stop": 7}, "stop"),
        ("/v1/completions", GOOD | {"logit_bias": {"5": "x"}}, "logit_bias.5"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", CHAT | {"messages": "Hi"}, "messages"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ("/v1/chat/completions", CHAT | {"n": 1.5}, "n"),
    ],
)
def test_wrong_types_are_a_400_naming_the_field(http, route, body, param):
    err = _error(http.post(route, json=body), 400)
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", GOOD | {"temperature": 5}, "temperature"),
        ("/v1/completions", GOOD | {"top_p": 0}, "top_p"),
        ("/v1/completions", GOOD | {"n": 0}, "n"),
        ("/v1/completions", GOOD | {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", GOOD | {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", GOOD | {"logprobs": 9}, "logprobs"),
        ("/v1/completions", GOOD | {"logit_bias": {"5": 500}}, "logit_bias.5"),
        ("/v1/completions", GOOD | {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", GOOD | {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", GOOD | {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", GOOD | {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", GOOD | {"prompt": ""}, "prompt"),
        ("/v1/completions", GOOD | {"prompt": []}, "prompt"),
        ("/v1/completions", GOOD | {"stream_options": {"include_usage": True}}, None),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, None),
        ("/v1/chat/completions", CHAT | {"messages": []}, "messages"),
        ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", CHAT | {"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_out_of_range_values_are_a_400(http, route, body, param):
    err = _error(http.post(route, json=body), 400)
    assert err["param"] == param, err


def test_over_long_prompt_states_the_limit_and_the_count(http, server):
    prompt = "hello " * (MAX_MODEL_LEN + 50)
    n = len(server.engine.tokenizer.encode(prompt))
    err = _error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in err["message"] and str(n) in err["message"]

    err = _error(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}), 400)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]


def test_unknown_model_is_a_404(http):
    err = _error(http.post("/v1/completions", json=GOOD | {"model": "gpt-9"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "gpt-9" in err["message"]
    _error(http.post("/v1/chat/completions", json=CHAT | {"model": "gpt-9"}), 404)


def test_oversized_body_is_a_413(http):
    body = b'{"prompt": "' + b"a" * (2 * 1024 * 1024 + 10) + b'"}'
    err = _error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)
    assert "2097152" in err["message"]

    def chunks():  # no content-length: the limit still holds
        for _ in range(3):
            yield b"a" * (1024 * 1024)

    _error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_method_are_openai_shaped(http):
    _error(http.get("/v1/nothing"), 404)
    _error(http.get("/v1/completions"), 405)


def test_the_server_still_serves_after_bad_input(http, server):
    for _ in range(3):
        http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        http.post("/v1/completions", json=GOOD | {"temperature": -1})
    res = http.post("/v1/completions", json=GOOD)
    assert res.status_code == 200 and res.json()["choices"][0]["text"]
    assert server.wait_idle()


def test_a_bad_prompt_in_a_list_leaves_nothing_running(http, server):
    prompts = ["Hello there", "hello " * (MAX_MODEL_LEN + 50)]
    err = _error(http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 300, "ignore_eos": True}), 400)
    assert err["code"] == "context_length_exceeded"
    assert server.wait_idle(timeout=5)
