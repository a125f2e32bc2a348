"""/metrics: a real Prometheus exposition that moves by exactly what was served."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families


def _scrape(http) -> dict[tuple[str, tuple], float]:  # noqa: ANN001
    res = http.get("/metrics")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(res.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _value(samples, name: str, **labels) -> float:  # noqa: ANN001
    labels = {"model_name": "smol"} | labels
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_by_the_served_amounts(http, server):
    prompts = ["The sky is", "Once upon a time there was"]
    lens = [len(server.engine.tokenizer.encode(p)) for p in prompts]
    before = _scrape(http)
    for p in prompts:
        res = http.post("/v1/completions", json={"model": "smol", "prompt": p, "max_tokens": 5, "ignore_eos": True})
        assert res.status_code == 200
    res = http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 3, "n": 2, "ignore_eos": True})
    assert res.status_code == 200
    hi = len(server.engine.tokenizer.encode("Hi"))
    after = _scrape(http)

    def delta(name: str, **labels) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("inferd:prompt_tokens_total") == sum(lens) + hi
    assert delta("inferd:generation_tokens_total") == 5 + 5 + 3 * 2
    assert delta("inferd:request_success_total", finished_reason="length") == 4  # n=2 counts each sample
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(f"inferd:{name}_count") == 3, name
    assert delta("inferd:request_generation_tokens_sum") == 16
    assert delta("inferd:request_prompt_tokens_sum") == sum(lens) + hi
    # Every output token after each sample's first is one inter-token gap.
    assert delta("inferd:inter_token_latency_seconds_count") == 4 + 4 + 2 * 2
    assert delta("inferd:prefix_cache_queries_total") == sum(lens) + hi * 2
    assert delta("inferd:prefix_cache_hits_total") == 0
    assert delta("inferd:e2e_request_latency_seconds_sum") > 0
    assert _value(after, "inferd:model_load_time_seconds") > 0
    assert after[("process_resident_memory_bytes", ())] > 100e6


def test_gauges_return_to_zero_when_idle(http, server):
    body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as res:
        lines = res.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        busy = _scrape(http)
        assert _value(busy, "inferd:num_requests_running") == 1
        assert _value(busy, "inferd:kv_cache_usage_perc") > 0
    assert server.wait_idle()
    deadline = time.monotonic() + 5
    idle = _scrape(http)
    while time.monotonic() < deadline and _value(idle, "inferd:num_requests_running"):
        time.sleep(0.05)
        idle = _scrape(http)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _value(idle, f"inferd:{gauge}") == 0, gauge
    assert _value(idle, "inferd:request_success_total", finished_reason="abort") >= 1


def test_speculative_decoding_counters_match_the_engine_and_text_matches_plain(http, server):
    from inferd.engine.engine import LLMEngine

    from tests.server.conftest import engine_config, live_server

    passage = "Rain fell on the old stone bridge, and the river carried the leaves away to the sea."
    body = {
        "prompt": f"Copy the text.\nText: {passage}\nCopy: {passage[:20]}",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    engine = LLMEngine(engine_config(speculative="ngram", num_kv_blocks=256))
    spec_server = live_server(engine, served_model_name="smol")
    try:
        import httpx

        with httpx.Client(base_url=spec_server.url, timeout=60) as c:
            res = c.post("/v1/completions", json=body)
            assert res.status_code == 200
            assert res.json()["choices"][0]["text"] == plain
            samples = _scrape(c)
    finally:
        spec_server.stop()
    sched = engine.scheduler
    assert sched.spec_num_accepted_tokens > 0
    assert _value(samples, "inferd:spec_decode_num_drafts_total") == sched.spec_num_drafts
    assert _value(samples, "inferd:spec_decode_num_draft_tokens_total") == sched.spec_num_draft_tokens
    assert _value(samples, "inferd:spec_decode_num_accepted_tokens_total") == sched.spec_num_accepted_tokens
