"""What the engine returns for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.types import TopLogprobs


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    # Cumulative text and token ids of this sample so far.
    text: str
    token_ids: list[int]
    # What this step added: the text is UTF-8 safe and never holds any part of a stop string.
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    # The stop string or stop token id that ended the sample, None for EOS or length.
    stop_reason: int | str | None = None
    # Per token: (chosen token's logprob, top alternatives), when asked for.
    logprobs: list[tuple[float, TopLogprobs]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when the request failed inside the engine (finish_reason "error").
    error: str | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
