"""A request's state inside the engine: token ids and progress counters.

Progress is two counters, not a mode: ``num_computed_tokens`` (tokens whose
K/V are in the cache) and ``num_tokens`` (prompt + output so far). A step
schedules some of the difference; when the two meet, a token is sampled.
Chunked prefill, decode and recompute after preemption are the same thing.
"""

from __future__ import annotations

import enum
import time

from inferd.sampling_params import SamplingParams
from inferd.types import TopLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, else None."""
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # Lower runs first: 0 interactive, 1 batch work (see WaitingQueue).
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Empty when the request ignores EOS.
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # Resolved against the context length at admission when the params leave it open.
        self.max_tokens: int | None = sampling_params.max_tokens

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Per output token: (chosen token's logprob, top alternatives), when asked for.
        self.output_logprobs: list[tuple[float, TopLogprobs]] = []
        self.num_computed_tokens = 0
        # Draft tokens proposed for the next step (speculative decoding); they
        # become output only once the target model has verified them.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0

        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
