"""The engine on the default model: parity with transformers, continuous
batching, preemption, stop strings, bad input."""

from __future__ import annotations

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.engine import LLMEngine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colors:\n1.",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 + 25?\nA:",
    "The quick brown fox",
    "Water boils at",
    "In machine learning, attention is",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def hf_greedy(hf_model, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    return [llm.tokenizer.encode(p) for p in PROMPTS[:7]] + [llm.tokenizer.encode(chat, add_special_tokens=False)]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    return [hf_greedy(hf_model, ids, 64) for ids in prompt_ids]


def test_greedy_matches_transformers_alone(llm, prompt_ids, reference):
    for ids, ref in zip(prompt_ids, reference):
        out = llm.generate([ids], GREEDY_64, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref


def test_greedy_matches_transformers_in_one_batch(llm, prompt_ids, reference):
    outs = llm.generate(prompt_ids, GREEDY_64, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_requests_joining_mid_decode_get_the_same_tokens(llm, prompt_ids, reference):
    engine: LLMEngine = llm.engine
    engine.add_request("first", prompt_ids[0], GREEDY_64)
    got: dict[str, list[int]] = {}
    for _ in range(5):
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
    assert 0 < len(got["first"]) < 64  # still decoding
    engine.add_request("second", prompt_ids[1], GREEDY_64)
    engine.add_request("third", prompt_ids[2], GREEDY_64)
    saw_mixed_step = False
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        running_before = {r.request_id for r in engine.scheduler.running}
        outs = engine.step()
        if "first" in running_before and any(o.request_id != "first" for o in outs):
            saw_mixed_step = True
        for out in outs:
            got[out.request_id] = out.outputs[0].token_ids
    assert saw_mixed_step
    assert [got["first"], got["second"], got["third"]] == reference[:3]


def test_small_kv_pool_preempts_without_changing_outputs(default_model_path, prompt_ids, reference):
    # 24 blocks of 16 tokens hold about three of these requests at once.
    small = LLM(str(default_model_path), dtype="float32", num_kv_blocks=24, max_model_len=2048)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=64, ignore_eos=True)
    outs = small.generate(prompt_ids, [GREEDY_64] * 4 + [sampled] * 4, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs[:4]] == reference[:4]
    # Seeded samples are the same as when each runs alone in a big pool.
    roomy = LLM(str(default_model_path), dtype="float32", num_kv_blocks=512, max_model_len=2048)
    for ids, out in zip(prompt_ids[4:], outs[4:]):
        alone = roomy.generate([ids], sampled, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_stop_string_spanning_tokens_is_never_emitted(llm, prompt_ids, reference):
    text = llm.tokenizer.decode(reference[3])
    # A stop string made of the end of one token and the start of later ones.
    start = len(llm.tokenizer.decode(reference[3][:10])) - 2
    stop = text[start : start + 9]
    assert len(llm.tokenizer.encode(stop, add_special_tokens=False)) >= 2
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=[stop])
    engine = llm.engine
    engine.add_request("stop", prompt_ids[3], params)
    deltas = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            final = out
    streamed = "".join(deltas)
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert streamed == final.outputs[0].text == text[: text.index(stop)]
    assert stop[:3] not in streamed[-3:]
    with_stop = llm.generate(
        [prompt_ids[3]], SamplingParams(temperature=0.0, max_tokens=64, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert with_stop.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm, prompt_ids, reference):
    target = reference[0][5]
    out = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[target]), use_tqdm=False)[0]
    first = reference[0].index(target)
    assert out.outputs[0].token_ids == reference[0][: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target
    short = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert short.outputs[0].token_ids == reference[0][:3] and short.outputs[0].finish_reason == "length"


def test_eos_ends_a_chat_reply(llm, prompt_ids):
    out = llm.generate([prompt_ids[7]], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.outputs[0].token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.outputs[0].text and out.outputs[0].text.strip()


def test_multibyte_text_streams_without_broken_characters(llm):
    prompt = "Translate to Chinese: Hello, world! 你好，世界！Emoji: 🙂👍🏽 Again: 你好，世界！"
    engine = llm.engine
    engine.add_request("utf8", prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    deltas = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            final = out
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final.outputs[0].text == llm.tokenizer.decode(final.outputs[0].token_ids)


def test_n_seeded_samples_are_distinct_and_reproducible(llm, prompt_ids):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt_ids[5]], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in alone.outputs]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3
    crowd = llm.generate(prompt_ids[:5] + [prompt_ids[5]], [GREEDY_64] * 5 + [params], use_tqdm=False)[-1]
    assert [c.token_ids for c in crowd.outputs] == samples


def test_logprobs_of_greedy_tokens_are_the_top_alternative(llm, prompt_ids, hf_model):
    out = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, (lp, top) in zip(c.token_ids, c.logprobs):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids[0]])).logits[0, -1]
    assert c.logprobs[0][0] == pytest.approx(torch.log_softmax(logits, -1)[c.token_ids[0]].item(), abs=1e-4)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("", {}, "prompt"),
        ("x " * 3000, {}, "context length"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -1}, "max_tokens"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.01}, "top_p"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"max_tokens": 5000}, "max_tokens"),
        ([1, 2, 10**9], {}, "token ids"),
        ("hi", {"logit_bias": {10**7: 1.0}}, "logit_bias"),
    ],
)
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(llm, prompt_ids, reference, prompt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], SamplingParams(**kwargs) if kwargs else None, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert ok.outputs[0].token_ids == reference[0][:8]


def test_unknown_model_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist.gguf"))
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(bogus=1)


def test_a_failing_step_fails_only_its_requests(llm, prompt_ids, reference, monkeypatch):
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    engine.add_request("doomed", prompt_ids[0], GREEDY_64)
    outs = engine.step()
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "error" and "injected" in outs[0].error
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    ok = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert ok.outputs[0].token_ids == reference[0][:8]


def test_abort_frees_blocks_at_once(llm, prompt_ids):
    engine = llm.engine
    engine.add_request("gone", prompt_ids[3], GREEDY_64)
    engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    engine.abort_request("gone")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert not engine.has_unfinished_requests()


def test_a_repeated_prefix_comes_from_the_cache_with_the_same_tokens(llm):
    system = "You are a careful assistant who answers in one short sentence. " * 6
    first_prompt = system + "Question: what is the color of the sky?"
    second_prompt = system + "Question: what do bees make?"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sched = llm.engine.scheduler
    cold = llm.generate([second_prompt], params, use_tqdm=False)[0]  # nothing of it cached yet
    llm.generate([first_prompt], params, use_tqdm=False)
    hits_before = sched.prefix_cache_hits
    warm = llm.generate([second_prompt], params, use_tqdm=False)[0]
    n = len(warm.prompt_token_ids)
    assert sched.prefix_cache_hits - hits_before == (n - 1) // 16 * 16  # all full blocks but the last token's
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
