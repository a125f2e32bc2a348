"""What the scheduler hands the runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    # Tokens of request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
    # run this step, at positions num_computed_tokens .. +num_new_tokens - 1.
    num_computed_tokens: int
    num_new_tokens: int
    # The request's whole block table (block ids), covering every token up to
    # num_computed_tokens + num_new_tokens.
    block_ids: list[int]
    # Draft tokens verified this step, after the request's last known token;
    # counted in num_new_tokens. Empty without speculative decoding.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens: its last
        known position's logits (and each draft token's) are sampled."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.num_computed_tokens + known == self.request.num_tokens

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are sampled: the last known token and each draft."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted this step (their blocks freed; recomputed later).
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
