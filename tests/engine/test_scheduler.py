import pytest

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request, RequestStatus
from inferd.engine.scheduler import Scheduler, SchedulerConfig
from inferd.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=64):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, kv)


def req(rid, prompt_len, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler, next_token=7):
    """One engine step without a model: every sampling request gets a token."""
    out = s.schedule()
    s.update_after_step(out)
    for sr in out.scheduled:
        if sr.num_computed_tokens + sr.num_new_tokens == sr.request.num_tokens:
            sr.request.append_output_token(next_token)
    return out


def plan(out):
    return [(sr.request.request_id, sr.num_computed_tokens, sr.num_new_tokens, sr.block_ids) for sr in out.scheduled]


def test_long_prompt_is_prefilled_in_chunks():
    s = make(budget=8)
    a = req("a", 20)
    s.add_request(a)
    assert plan(step(s)) == [("a", 0, 8, [0, 1])]
    assert plan(step(s)) == [("a", 8, 8, [0, 1, 2, 3])]
    out = step(s)
    assert plan(out) == [("a", 16, 4, [0, 1, 2, 3, 4])]
    assert a.output_token_ids == [7]
    # Decode: one token a step, new block when position 20 starts block 5.
    assert plan(step(s)) == [("a", 20, 1, [0, 1, 2, 3, 4, 5])]


def test_decodes_keep_flowing_while_a_long_prompt_prefills():
    s = make(budget=8)
    a = req("a", 3)
    s.add_request(a)
    step(s)  # a prefilled and sampled its first token
    b = req("b", 30)
    s.add_request(b)
    # a decodes one token; b takes the rest of the budget.
    assert plan(step(s)) == [("a", 3, 1, [0]), ("b", 0, 7, [1, 2])]
    # b is now running too; a keeps one token each step.
    assert plan(step(s)) == [("a", 4, 1, [0, 3]), ("b", 7, 7, [1, 2, 4, 5])]


def test_running_prefill_keeps_one_token_for_each_request_behind_it():
    s = make(budget=8)
    a, b = req("a", 30), req("b", 2)
    s.add_request(a)
    s.add_request(b)
    # Both admitted in arrival order: a takes the whole budget first step.
    assert plan(step(s)) == [("a", 0, 8, [0, 1])]
    # b is still waiting: the budget went to a.
    assert [r.request_id for r in s.waiting] == ["b"]


def test_waiting_requests_admitted_in_arrival_order_up_to_max_num_seqs():
    s = make(budget=16, max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2))
    assert plan(step(s)) == [("a", 0, 2, [0]), ("b", 0, 2, [1])]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert plan(step(s)) == [("a", 2, 1, [0]), ("b", 2, 1, [1])]


def test_the_last_request_preempts_itself_when_it_cannot_grow():
    # 3 blocks of 2 tokens: a and b fill one block each; then both need a second.
    s = make(num_blocks=3, block_size=2, budget=8, max_num_seqs=4, max_model_len=16)
    a, b = req("a", 2, max_tokens=4), req("b", 2, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert plan(step(s)) == [("a", 0, 2, [0]), ("b", 0, 2, [1])]
    # a takes the last free block; b, last admitted, finds none and yields.
    out = step(s)
    assert plan(out) == [("a", 2, 1, [0, 2])]
    assert out.preempted_ids == ["b"] and list(s.waiting) == [b]
    assert s.kv_cache.block_ids("b") == [] and s.kv_cache.num_free_blocks == 1


def test_preemption_when_the_pool_runs_out():
    s = make(num_blocks=3, block_size=2, budget=8, max_num_seqs=4, max_model_len=16)
    a, b = req("a", 3, max_tokens=4), req("b", 1, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert plan(step(s)) == [("a", 0, 3, [0, 1]), ("b", 0, 1, [2])]
    # a: 4 tokens, needs position 3 -> block 1 has room. b: position 1 -> block 2 has room.
    assert plan(step(s)) == [("a", 3, 1, [0, 1]), ("b", 1, 1, [2])]
    # a needs a third block for position 4; none free: b (admitted last) is preempted.
    out = step(s)
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 4, 1, [0, 1, 2])]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7] and s.waiting[0] is b and s.num_preemptions == 1
    # No admission in the step that preempted; afterwards b waits until blocks free up.
    s.finish_request(a, RequestStatus.FINISHED_LENGTH)
    assert s.kv_cache.num_free_blocks == 3
    # b recomputes its prompt plus the two tokens it produced, then samples its third.
    out = step(s)
    assert plan(out) == [("b", 0, 3, [2, 1])]
    assert b.output_token_ids == [7, 7, 7] and b.status is RequestStatus.RUNNING


def test_an_earlier_request_preempts_the_last_admitted():
    s = make(num_blocks=2, block_size=2, budget=8, max_model_len=16)
    a, b = req("a", 2, max_tokens=2), req("b", 2, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both hold one full block; each now needs a second one
    out = step(s)
    # a's allocation fails, so b is preempted and a gets b's block.
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 2, 1, [0, 1])]


def test_check_fits_rejects_what_can_never_run():
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        s.check_fits(0, 4)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens.*40 tokens \\(30 in the prompt, 10"):
        s.check_fits(30, 10)
    with pytest.raises(ValueError, match="maximum context length is 32 tokens, but the prompt has 32"):
        s.check_fits(32, None)
    with pytest.raises(ValueError, match="needs 5 KV-cache blocks"):
        s.check_fits(10, 10)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        s.check_fits(10, None)  # 32 tokens = 8 blocks > 4
    assert s.check_fits(4, 12) == 12


def test_finish_request_removes_from_either_queue_and_frees():
    s = make()
    a, b = req("a", 4), req("b", 4)
    s.add_request(a)
    step(s)
    s.add_request(b)
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert b.status is RequestStatus.FINISHED_ABORTED and not s.waiting
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert not s.running and s.kv_cache.num_free_blocks == 16 and not s.has_unfinished


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_model_len=8, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        SchedulerConfig(max_model_len=8, max_num_seqs=8, max_num_batched_tokens=4)


def _prio(rid, prompt_len, priority, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), priority=priority)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make(max_num_seqs=1, budget=64)
    for r in (_prio("batch1", 4, 1), _prio("batch2", 4, 1), _prio("chat1", 4, 0), _prio("chat2", 4, 0)):
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["chat1", "chat2", "batch1", "batch2"]
    assert s.num_waiting == 4
    assert plan(step(s)) == [("chat1", 0, 4, [0])]


def test_preemption_takes_the_lowest_priority_first():
    # 4 blocks of 4 tokens.
    s = make(num_blocks=4, block_size=4, max_num_seqs=3, budget=64)
    batch, chat_a, chat_b = _prio("batch", 4, 1), _prio("chat_a", 4, 0), _prio("chat_b", 4, 0)
    s.add_request(batch)
    step(s)  # batch prefilled: block 0
    s.add_request(chat_a)
    s.add_request(chat_b)
    assert plan(step(s)) == [("batch", 4, 1, [0, 1]), ("chat_a", 0, 4, [2]), ("chat_b", 0, 4, [3])]
    # The chats grow into a full pool: batch (paused, lowest priority) gives its blocks back.
    out = step(s)
    assert out.preempted_ids == ["batch"]
    assert batch.status is RequestStatus.PREEMPTED and batch.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["batch"]
    assert plan(out) == [("chat_a", 4, 1, [2, 1]), ("chat_b", 4, 1, [3, 0])]


def test_waiting_queue_front_insert_and_remove_by_level():
    from inferd.engine.scheduler import WaitingQueue

    q = WaitingQueue()
    a, b, c = _prio("a", 1, 1), _prio("b", 1, 0), _prio("c", 1, 1)
    q.append(a)
    q.append(b)
    q.appendleft(c)  # a preempted batch request: front of its level, behind interactive
    assert [r.request_id for r in q] == ["b", "c", "a"]
    assert q[0] is b and q.popleft() is b
    q.remove(a)
    assert [r.request_id for r in q] == ["c"] and len(q) == 1 and bool(q)
    q.popleft()
    assert not q
    with pytest.raises(IndexError):
        q.popleft()


def test_lower_priority_requests_pause_while_a_higher_one_runs():
    s = make(budget=64, max_num_seqs=4)
    batch = _prio("batch", 4, 1)
    s.add_request(batch)
    assert plan(step(s)) == [("batch", 0, 4, [0])]
    chat = _prio("chat", 4, 0, max_tokens=2)
    s.add_request(chat)
    # Only batch ran when the step began: it decodes, and chat is admitted beside it.
    assert plan(step(s)) == [("batch", 4, 1, [0, 1]), ("chat", 0, 4, [2])]
    # chat runs: batch keeps its blocks but takes no tokens until chat is done.
    assert plan(step(s)) == [("chat", 4, 1, [2, 3])]
    assert batch.num_computed_tokens == 5 and s.kv_cache.block_ids("batch") == [0, 1]
    s.finish_request(chat, RequestStatus.FINISHED_STOPPED)
    assert plan(step(s)) == [("batch", 5, 1, [0, 1])]


def test_lower_priority_requests_wait_for_admission_while_a_higher_one_runs():
    s = make(budget=64, max_num_seqs=4)
    chat = _prio("chat", 4, 0, max_tokens=2)
    s.add_request(chat)
    step(s)
    s.add_request(_prio("batch", 4, 1))
    assert plan(step(s)) == [("chat", 4, 1, [0, 1])]
    assert [r.request_id for r in s.waiting] == ["batch"]
    s.finish_request(chat, RequestStatus.FINISHED_STOPPED)
    assert plan(step(s)) == [("batch", 0, 4, [1])]


def test_lower_priority_work_takes_a_quarter_of_the_step_budget():
    s = make(num_blocks=32, budget=64, max_num_seqs=4)
    s.add_request(_prio("batch", 40, 1))
    assert plan(step(s)) == [("batch", 0, 16, [0, 1, 2, 3])]
    assert plan(step(s)) == [("batch", 16, 16, [0, 1, 2, 3, 4, 5, 6, 7])]
    s.add_request(Request("chat", list(range(100, 140)), SamplingParams(max_tokens=8)))
    # Interactive work is not held to the share: it takes its 40 at once.
    assert plan(step(s)) == [("batch", 32, 8, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
                             ("chat", 0, 40, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])]
