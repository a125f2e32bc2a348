"""Speculative decoding: proposals, verification, scheduling, and the engine's
output being exactly plain decoding's."""

from __future__ import annotations

import pytest

from inferd import LLM, SamplingParams
from inferd.config import EngineConfig
from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.engine.spec_decode import AdaptiveSpeculation, DraftPosition, NgramProposer, num_accepted

# Proposals ------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(num_speculative_tokens=3, max_ngram=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    # "6 7" ends the sequence; its latest earlier match is at 6..7, followed by 3 4 6.
    assert p.propose_one(tokens) == [3, 4, 6]
    # A trigram match wins over a later bigram one.
    tokens = [1, 2, 3, 8, 8, 9, 2, 3, 5, 1, 2, 3]
    assert p.propose_one(tokens) == [8, 8, 9]


def test_ngram_respects_the_limit_and_the_end_of_the_sequence():
    p = NgramProposer(num_speculative_tokens=4)
    assert p.propose_one([1, 2, 3, 1, 2], limit=1) == [3]
    assert p.propose_one([1, 2, 3, 1, 2], limit=0) == []
    assert p.propose_one([1, 2, 1]) == [2, 1]  # only what exists after the match
    assert p.propose_one([1, 2, 3, 4]) == []  # no repeat at all
    assert p.propose_one([7]) == []


def test_ngram_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(2, max_ngram=1, min_ngram=2)


def test_num_accepted_stops_at_the_first_mismatch():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert num_accepted([], [3]) == 0
    with pytest.raises(ValueError, match="sampled"):
        num_accepted([4, 5], [4, 5])


def test_draft_position_sees_the_drafts_before_it():
    r = Request("r", [1, 2], SamplingParams(max_tokens=8))
    r.append_output_token(3)
    view = DraftPosition(r, [4, 5])
    assert view.output_token_ids == [3, 4, 5]
    assert r.output_token_ids == [3]  # the request itself is untouched
    assert view.prompt_token_ids == [1, 2] and view.sampling_params is r.sampling_params


def test_adaptive_speculation_backs_off_longer_each_failure_and_recovers():
    a = AdaptiveSpeculation(min_acceptance=0.5, min_samples=4, decay=1.0, base_skip=2, max_skip=8)
    assert a.should_propose("r")
    a.observe("r", proposed=4, accepted=0)  # 0% of 4: back off 2 steps
    assert [a.should_propose("r") for _ in range(3)] == [False, False, True]
    a.observe("r", proposed=4, accepted=1)  # fails again: 4 steps
    assert [a.should_propose("r") for _ in range(5)] == [False] * 4 + [True]
    a.observe("r", proposed=4, accepted=4)  # good drafts keep it on
    assert a.should_propose("r")
    a.forget("r")
    assert a.should_propose("r")


# Scheduling -----------------------------------------------------------------


def _scheduler(budget=16):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=budget), kv)


def _decoding(s: Scheduler, *prompt_lens: int) -> list[Request]:
    """Requests prefilled in one step, each with one sampled token to decode."""
    reqs = [Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=16)) for i, n in enumerate(prompt_lens)]
    for r in reqs:
        s.add_request(r)
    s.update_after_step(s.schedule())
    for r in reqs:
        r.append_output_token(50)
    return reqs


def test_drafts_ride_with_the_decode_and_rejections_rewind_progress():
    s = _scheduler()
    [r] = _decoding(s, 6)
    assert (r.num_computed_tokens, r.num_tokens) == (6, 7)
    r.spec_token_ids = [60, 61, 62]
    out = s.schedule()
    [item] = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.spec_token_ids) == (6, 4, [60, 61, 62])
    assert item.samples and item.num_sample_rows == 4
    assert item.block_ids == [0, 1, 2]  # slots for 6 + 4 tokens
    assert r.spec_token_ids == []  # consumed by the step
    s.update_after_step(out, {"r0": 2})  # one draft confirmed
    assert r.num_computed_tokens == 8
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (1, 3, 1)
    with pytest.raises(ValueError, match="rejected"):
        s.update_after_step(out, {"r0": 4})


def test_drafts_are_cut_to_the_budget_left_for_the_requests_behind():
    s = _scheduler(budget=4)
    a, _ = _decoding(s, 2, 1)  # r1 decodes behind r0
    a.spec_token_ids = [7, 8, 9, 10]
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled] == [
        ("r0", 3, [7, 8]),
        ("r1", 1, []),
    ]


def test_config_validates_speculative_settings():
    assert EngineConfig(speculative="ngram").speculative_method() == ("ngram", None)
    assert EngineConfig(speculative="draft:/m.gguf").speculative_method() == ("draft", "/m.gguf")
    for bad in ("eagle", "draft:", ""):
        with pytest.raises(ValueError, match="speculative"):
            EngineConfig(speculative=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# The engine ------------------------------------------------------------------

PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He trimmed the wick, "
    "polished the lens, and wrote the weather in a small green book. Ships passed far out "
    "on the water, and none of them knew his name."
)


def _mixed_requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    repeat = f"Copy this text exactly.\n\nText: {PASSAGE}\n\nCopy: {PASSAGE[:60]}"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return [
        (tokenizer.encode(repeat), greedy),
        (tokenizer.encode(chat, add_special_tokens=False), greedy),
        (tokenizer.encode("1, 2, 3, 4, 5,"), SamplingParams(temperature=0.0, max_tokens=40, stop=["12"])),
        (tokenizer.encode(repeat), SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40)),
        (tokenizer.encode(PASSAGE), SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True)),
        (tokenizer.encode(repeat), SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3)),
    ]


@pytest.fixture(scope="module")
def spec_llm(default_model_path):
    return LLM(
        str(default_model_path),
        dtype="float32",
        kv_cache_memory_gb=1.0,
        max_model_len=2048,
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_max_batch=8,
    )


def _summary(outputs):
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]


def test_ngram_speculation_gives_plain_decodings_output_under_a_mixed_batch(llm, spec_llm):
    requests = _mixed_requests(llm.tokenizer)
    prompts = [ids for ids, _ in requests]
    params = [p for _, p in requests]
    plain = llm.generate(prompts, params, use_tqdm=False)
    sched = spec_llm.engine.scheduler
    before = (sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(spec) == _summary(plain)
    # Logprobs come from the same positions' logits.
    got_lp, want_lp = spec[4].outputs[0].logprobs, plain[4].outputs[0].logprobs
    assert len(got_lp) == len(want_lp) == 30
    for (chosen, top), (want_chosen, want_top) in zip(got_lp, want_lp):
        assert chosen == pytest.approx(want_chosen, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
    drafted = sched.spec_num_draft_tokens - before[0]
    accepted = sched.spec_num_accepted_tokens - before[1]
    # Both paths ran: drafts accepted (the copy task) and rejected.
    assert 0 < accepted < drafted


def test_speculation_is_off_above_the_batch_limit(default_model_path):
    llm = LLM(
        str(default_model_path), dtype="float32", kv_cache_memory_gb=0.2, max_model_len=512,
        speculative="ngram", speculative_max_batch=1,
    )
    ids = llm.tokenizer.encode(f"{PASSAGE} {PASSAGE}")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([ids, ids], params, use_tqdm=False)
    assert llm.engine.scheduler.spec_num_drafts == 0
    llm.generate([ids], params, use_tqdm=False)
    assert llm.engine.scheduler.spec_num_drafts > 0


# Draft-model proposals -------------------------------------------------------


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory, default_model_path):
    """A tiny random Llama over the default model's vocabulary: its drafts are
    mostly wrong, which exercises rejection."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("draft") / "tiny-draft"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("draft", ["self", "random"])
def test_draft_model_speculation_gives_plain_decodings_output(llm, default_model_path, random_draft_dir, draft):
    path = default_model_path if draft == "self" else random_draft_dir
    spec = LLM(
        str(default_model_path), dtype="float32", kv_cache_memory_gb=0.5, max_model_len=2048,
        speculative=f"draft:{path}", num_speculative_tokens=3, speculative_max_batch=8,
    )
    requests = _mixed_requests(llm.tokenizer)[:4]
    prompts = [ids for ids, _ in requests]
    params = [p for _, p in requests]
    assert _summary(spec.generate(prompts, params, use_tqdm=False)) == _summary(
        llm.generate(prompts, params, use_tqdm=False)
    )
    sched = spec.engine.scheduler
    rate = sched.spec_num_accepted_tokens / sched.spec_num_draft_tokens
    if draft == "self":
        assert rate > 0.9  # the target drafting for itself is nearly always right
    else:
        assert rate < 0.5
    # A second round reuses the draft's KV for what it already computed.
    again = spec.generate(prompts[:1], params[:1], use_tqdm=False)
    assert again[0].outputs[0].token_ids == llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0].token_ids


def test_draft_model_must_share_the_vocabulary(default_model_path, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.test_hf_loader import TINY_LLAMA

    from transformers import AutoTokenizer

    path = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)

    AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name).save_pretrained(path)
    with pytest.raises(ValueError, match="draft model .* vocabulary of 128 tokens, the target 49152"):
        LLM(str(default_model_path), kv_cache_memory_gb=0.1, speculative=f"draft:{path}")
