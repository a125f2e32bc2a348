"""Turns sampled tokens into text, stop decisions and ``RequestOutput``s.

A user request with ``n`` samples is one ``RequestState`` holding ``n`` engine
``Request``s (children); its outputs carry all ``n`` completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inferd.engine.request import Request, RequestStatus


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    # Per child: how many output tokens were already reported.
    num_reported_tokens: list[int] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self.num_reported_tokens = [0] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


def check_stop(
    request: Request, detokenizer: IncrementalDetokenizer, max_model_len: int
) -> RequestStatus | None:
    """Feed the request's newest token to its detokenizer and decide whether
    the request is done. Sets ``request.stop_reason`` when a stop token or
    stop string ended it."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    num_output = request.num_output_tokens
    # The sampler already masks EOS and stop ids while fewer than min_tokens
    # were generated; checking again keeps a stray id from ending it early.
    if num_output > params.min_tokens:
        if token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    stop = detokenizer.update([token], num_output)
    if stop is not None:
        request.stop_reason = stop
        return RequestStatus.FINISHED_STOPPED
    if request.max_tokens is not None and num_output >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def make_output(state: RequestState) -> RequestOutput:
    """The request's output now, with the deltas since the last call."""
    completions = []
    for i, (child, detok) in enumerate(zip(state.children, state.detokenizers)):
        finished = child.is_finished
        reported = state.num_reported_tokens[i]
        state.num_reported_tokens[i] = child.num_output_tokens
        params = child.sampling_params
        # The delta first: text is what has been released so far, so a
        # streamed cumulative text never shows a held-back stop-string prefix.
        delta = detok.get_delta(finished)
        completions.append(
            CompletionOutput(
                index=i,
                text=detok.emitted_text,
                token_ids=list(child.output_token_ids),
                text_delta=delta,
                new_token_ids=child.output_token_ids[reported:],
                finish_reason=child.status.finish_reason,
                stop_reason=child.stop_reason,
                logprobs=list(child.output_logprobs) if params.logprobs is not None else None,
            )
        )
    first = state.children[0]
    token_times = [c.first_token_time for c in state.children if c.first_token_time is not None]
    finish_times = [c.finish_time for c in state.children if c.finish_time is not None]
    scheduled = [c.scheduled_time for c in state.children if c.scheduled_time is not None]
    metrics = RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=min(scheduled) if scheduled else None,
        first_token_time=min(token_times) if token_times else None,
        finish_time=max(finish_times) if state.finished and finish_times else None,
        num_preemptions=sum(c.num_preemptions for c in state.children),
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=state.finished,
        metrics=metrics,
        error=state.error,
    )
