"""Iteration-level scheduler under one token budget per step. No torch here.

Every step gets ``max_num_batched_tokens`` tokens to hand out. Running
requests come first, in admission order: a decoding request takes one token,
a request still prefilling takes as much of its prompt as the budget allows,
minus one token kept back for each running request behind it, so a long
prompt is prefilled in chunks while the others keep decoding. What budget is
left goes to waiting requests in arrival order, up to ``max_num_seqs``
running at once. Draft tokens proposed for a decoding request (speculative
decoding) are scheduled with its decode and take budget like any token.

When the pool has no block for a running request, the most recently admitted
running request is preempted: its blocks are freed, its progress reset, and it
goes back to the front of the queue to be recomputed from its prompt and the
tokens it already produced, so its output is the same as if it had never been
preempted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from inferd.engine.kv_cache import KVCacheManager
from inferd.engine.request import Request, RequestStatus
from inferd.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class ContextLengthError(ValueError):
    """A request longer than the context length or the whole KV cache."""


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs so every running request "
                f"can decode each step, got {self.max_num_batched_tokens} < {self.max_num_seqs}"
            )


# Lower-priority (batch) requests take at most 1/LOW_PRIORITY_SHARE of a step's token budget.
LOW_PRIORITY_SHARE = 4


class WaitingQueue:
    """Requests waiting for admission: by priority (lower first), then in
    arrival order; a preempted request goes back to the front of its level.
    The deque operations the scheduler uses, over one deque per level."""

    def __init__(self) -> None:
        self._levels: dict[int, deque[Request]] = {}

    def _level(self, priority: int) -> deque[Request]:
        if priority not in self._levels:
            self._levels[priority] = deque()
            self._levels = dict(sorted(self._levels.items()))
        return self._levels[priority]

    def append(self, request: Request) -> None:
        self._level(request.priority).append(request)

    def appendleft(self, request: Request) -> None:
        self._level(request.priority).appendleft(request)

    def _first_level(self) -> deque[Request]:
        for level in self._levels.values():
            if level:
                return level
        raise IndexError("no request is waiting")

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the queue can be read")
        return self._first_level()[0]

    def popleft(self) -> Request:
        return self._first_level().popleft()

    def remove(self, request: Request) -> None:
        self._levels[request.priority].remove(request)

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels.values())

    def __bool__(self) -> bool:
        return any(self._levels.values())

    def __iter__(self) -> Iterator[Request]:
        for level in self._levels.values():
            yield from level


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Speculative decoding: steps that verified drafts, drafts, accepted.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    # Admission -------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> int:
        """Validate a request's size; returns its max_tokens resolved against
        the context length. Raises ValueError when it can never run."""
        limit = self.config.max_model_len
        if prompt_len == 0:
            raise ValueError("prompt must not be empty")
        if prompt_len >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens, but the prompt "
                f"has {prompt_len} tokens (prompt): leave room for at least one output token"
            )
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion; max_tokens). Reduce the prompt or max_tokens."
            )
        blocks = self.kv_cache.blocks_needed(prompt_len + max_tokens)
        if blocks > self.kv_cache.num_blocks:
            raise ContextLengthError(
                f"request needs {blocks} KV-cache blocks ({prompt_len} prompt + {max_tokens} "
                f"max_tokens) but the whole cache holds {self.kv_cache.num_blocks}; "
                "reduce max_tokens or give the KV cache more memory"
            )
        return max_tokens

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # One step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.time()

        # Lower-priority requests pause (keep their blocks, take no tokens)
        # while a higher-priority one runs: batch work steps aside for
        # interactive requests instead of slowing every step they share.
        top = min((r.priority for r in self.running), default=0)
        # Batch work (priority > 0) gets a share of the step's tokens, so a
        # step stays short and an interactive arrival waits less for the next.
        low_budget = max(1, budget // LOW_PRIORITY_SHARE)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.priority > top:
                i += 1
                continue
            behind = sum(1 for r in self.running[i + 1 :] if r.priority <= top)
            room = max(1, budget - behind)
            if request.priority > 0:
                room = max(1, min(room, low_budget - sum(1 for r in self.running[i + 1 :] if r.priority > 0)))
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, room)
            # Draft tokens ride along with a decode, as far as the budget goes.
            spec = request.spec_token_ids[: room - 1] if remaining == 1 else []
            request.spec_token_ids = []
            num_new += len(spec)
            while self.kv_cache.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new
            ) is None:
                at = self._victim(i, top)
                victim = self.running.pop(at)
                if at < i:  # a paused request before this one
                    i -= 1
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new, spec))
                budget -= num_new
                if request.priority > 0:
                    low_budget -= num_new
                i += 1

        if not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if self.running and request.priority > min(r.priority for r in self.running):
                    break  # it would only pause; the queue is in priority order
                if not self.kv_cache.has(request.request_id):
                    request.num_computed_tokens = self.kv_cache.get_computed_blocks(
                        request.request_id, request.all_token_ids
                    )
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if request.priority > 0:
                    if low_budget <= 0:
                        break
                    num_new = min(num_new, low_budget)
                if self.kv_cache.allocate_slots(
                    request.request_id, request.num_computed_tokens + num_new
                ) is None:
                    break
                self.waiting.popleft()
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += request.num_computed_tokens
                request.status = RequestStatus.RUNNING
                if request.scheduled_time is None:
                    request.scheduled_time = now
                self.running.append(request)
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                if request.priority > 0:
                    low_budget -= num_new
        return out

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | None = None) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_computed_tokens=request.num_computed_tokens,
            num_new_tokens=num_new,
            block_ids=self.kv_cache.block_ids(request.request_id),
            spec_token_ids=spec or [],
        )

    def _victim(self, current: int, top: int) -> int:
        """Where in ``running`` the request to preempt is, when the one at
        ``current`` cannot grow: of those not scheduled yet this step (from
        ``current`` on, and the paused ones), the lowest priority, and of
        those the most recently admitted (with one priority: the last one)."""
        candidates = [j for j, r in enumerate(self.running) if j >= current or r.priority > top]
        return max(candidates, key=lambda j: (self.running[j].priority, j))

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput, num_rejected: Mapping[str, int] | None = None) -> None:
        """Advance the counters of every request that ran this step.

        ``num_rejected`` counts, per request, the draft tokens the model did
        not confirm: their K/V slots were written but hold nothing, so the
        request's progress stops before them and the next step overwrites them.
        """
        for s in out.scheduled:
            request = s.request
            rejected = num_rejected.get(request.request_id, 0) if num_rejected else 0
            if not 0 <= rejected <= len(s.spec_token_ids):
                raise ValueError(
                    f"request {request.request_id}: {rejected} rejected of "
                    f"{len(s.spec_token_ids)} draft tokens"
                )
            request.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens - rejected
            if s.spec_token_ids:
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += len(s.spec_token_ids)
                self.spec_num_accepted_tokens += len(s.spec_token_ids) - rejected
            # Blocks this step filled can now be shared by later requests.
            self.kv_cache.cache_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)

    # Leaving ---------------------------------------------------------------

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished, aborted or failed) and free its blocks."""
        assert status.finished, status
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = time.time()
        self.kv_cache.free(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
