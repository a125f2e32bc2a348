"""Draft-model proposals for speculative decoding.

A small model with the target's vocabulary guesses the next ``k`` tokens
greedily: one forward pass that catches its KV cache up with the request's
tokens and yields the first draft, then one single-token pass per further
draft, batched over the requests. Greedy drafts are deterministic, so the
target's verification (``spec_decode``) keeps the target's own distribution.

The draft's KV cache is a second pool indexed by the target's block tables:
a request's draft K/V for position ``p`` sits at the same slot as its target
K/V. The proposer therefore grows a request's table (through the target's
``KVCacheManager``) to cover the positions it writes, skipping the request
when the pool is full; the scheduler later finds those slots allocated.

What the draft cache holds is tracked per request as ``draft_computed``:
positions below it hold the draft's K/V of the request's actual tokens. It
falls back to the target's progress after rejected drafts and to zero after
a preemption, since the request's blocks may then be other ones, or shared
prefix-cache blocks whose draft slots another request never wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request
from inferd.engine.runner import ModelRunner, greedy_sample
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from inferd.sampling_params import SamplingParams


class _Extended:
    """A request with draft tokens appended, as the draft runner reads it."""

    __slots__ = ("all_token_ids", "request_id", "sampling_params")

    def __init__(self, request: Request, drafts: Sequence[int]) -> None:
        self.request_id = request.request_id
        self.sampling_params: SamplingParams = request.sampling_params
        self.all_token_ids = request.all_token_ids + list(drafts)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _DraftState:
    computed: int = 0  # leading positions whose draft K/V is valid
    preemptions: int = 0  # the request's preemption count when it was set


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, num_speculative_tokens: int) -> None:
        if runner.num_blocks != kv_cache.num_blocks or runner.block_size != kv_cache.block_size:
            raise ValueError(
                "the draft runner's KV pool must match the target's blocks: "
                f"{runner.num_blocks}x{runner.block_size} vs {kv_cache.num_blocks}x{kv_cache.block_size}"
            )
        if num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {num_speculative_tokens}")
        self.runner = runner
        self.runner.sampler = greedy_sample
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        self._states: dict[str, _DraftState] = {}

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        wanted: dict[int, int] = {}  # index of each request drafting this step -> its k
        first = SchedulerOutput()
        for i, (req, limit) in enumerate(zip(requests, limits, strict=True)):
            k = min(limit, self.num_speculative_tokens)
            if k <= 0:
                continue
            state = self._state(req)
            # Slots for the catch-up and for the drafts written after it.
            if self.kv_cache.allocate_slots(req.request_id, req.num_tokens + k - 1) is None:
                continue
            start = state.computed
            first.scheduled.append(
                ScheduledRequest(req, start, req.num_tokens - start, self.kv_cache.block_ids(req.request_id))
            )
            wanted[i] = k
        if not wanted:
            return drafts
        index = {requests[i].request_id: i for i in wanted}
        sampled = self.runner.execute(first).sampled
        for i in wanted:
            req = requests[i]
            drafts[i].append(sampled[req.request_id][0][0])
            self._states[req.request_id].computed = req.num_tokens
        for step in range(1, self.num_speculative_tokens):
            sched = SchedulerOutput()
            for i, k in wanted.items():
                req = requests[i]
                if len(drafts[i]) >= k:
                    continue
                view = _Extended(req, drafts[i])
                # The newest draft runs at position num_tokens - 1 + step.
                sched.scheduled.append(
                    ScheduledRequest(view, view.num_tokens - 1, 1, self.kv_cache.block_ids(req.request_id))  # type: ignore[arg-type]
                )
            if sched.is_empty:
                break
            sampled = self.runner.execute(sched).sampled
            for item in sched.scheduled:
                rid = item.request.request_id
                drafts[index[rid]].append(sampled[rid][0][0])
                self._states[rid].computed = item.num_computed_tokens + 1
        return drafts

    def _state(self, req: Request) -> _DraftState:
        state = self._states.get(req.request_id)
        if state is None or state.preemptions != req.num_preemptions:
            state = self._states[req.request_id] = _DraftState(0, req.num_preemptions)
        # Drafts past what the target confirmed hold rejected tokens.
        state.computed = min(state.computed, req.num_computed_tokens)
        return state

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
