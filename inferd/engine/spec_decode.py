"""Speculative decoding: cheap proposals, verified by the target in one pass.

A proposer guesses the next ``k`` tokens of a decoding request; the scheduler
runs them after the request's last token, so one forward pass of the target
model yields logits at the last token and at each draft. The runner samples
every one of those positions exactly as plain decoding would (the sampler
sees the request with the drafts before that position appended, so
penalties, ``min_tokens`` and seeded draws match) and keeps drafts while they
equal what it sampled. The first mismatch is replaced by the sampled token;
when all ``k`` match, the token sampled after the last draft is a bonus.

Proposals here are deterministic (a one-hot draft distribution q). For such
q, rejection sampling accepts draft x with probability min(1, p(x)/q(x)) =
p(x) and on rejection draws from the residual max(0, p - q), which is p with
x removed: exactly what drawing y ~ p and accepting when y == x does. So the
output has the target's distribution at any temperature, is the greedy output
at temperature 0, and for a seeded request is token for token the output of
plain decoding.

Proposers:

- ``NgramProposer`` (prompt lookup): finds the latest earlier occurrence of
  the request's last n tokens and proposes what followed it. Free to run and
  strong when the output repeats its input (extraction, editing, code).
- ``DraftModelProposer`` lives with the runner (it needs a model); it
  implements the same ``propose`` call.

Each request backs off on its own when its drafts keep failing, so
open-ended text pays for few wasted verifications.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from inferd.engine.request import Request
from inferd.sampling_params import SamplingParams


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """Up to ``limits[i]`` draft tokens following each request's tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that has left."""
        ...


class DraftPosition:
    """A request as the sampler sees it at one draft position: its output
    extended by the drafts before that position."""

    __slots__ = ("eos_token_ids", "output_token_ids", "prompt_token_ids", "request_id", "sampling_params")

    def __init__(self, request: Request, drafts: Sequence[int]) -> None:
        self.request_id: str = request.request_id
        self.sampling_params: SamplingParams = request.sampling_params
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.eos_token_ids: frozenset[int] = request.eos_token_ids
        self.output_token_ids: list[int] = request.output_token_ids + list(drafts)


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Leading drafts equal to the token sampled at their position.

    ``sampled[i]`` is the token drawn after the last known token and
    ``drafts[:i]``; ``len(sampled) == len(drafts) + 1``.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} sampled tokens for {len(drafts)} drafts, got {len(sampled)}")
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass
class NgramProposer:
    """Prompt-lookup proposals: the tokens that followed the latest earlier
    match of the request's last ``n`` tokens, longest ``n`` first."""

    num_speculative_tokens: int
    max_ngram: int = 4
    min_ngram: int = 1
    # Only the last ``window`` tokens are searched: bounds the cost per step.
    window: int = 4096

    def __post_init__(self) -> None:
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if not 0 < self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 0 < min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(r.all_token_ids, k) for r, k in zip(requests, limits, strict=True)]

    def forget(self, request_id: str) -> None:
        pass  # keeps nothing per request

    def propose_one(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        k = self.num_speculative_tokens if limit is None else min(limit, self.num_speculative_tokens)
        if k <= 0 or len(token_ids) < self.min_ngram + 1:
            return []
        tokens = np.asarray(token_ids[-self.window :], dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = tokens[length - n :]
            # Windows that end before the last token, so something follows them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


@dataclass
class _Record:
    proposed: float = 0.0  # decayed counts
    accepted: float = 0.0
    skip: int = 0  # steps left without proposing
    failures: int = 0  # back-offs in a row


@dataclass
class AdaptiveSpeculation:
    """Per-request back-off: a request whose drafts are mostly rejected stops
    proposing for a while, longer each time it fails again, so text that does
    not repeat itself runs at plain-decoding speed.

    Acceptance is a decayed ratio of accepted to proposed draft tokens; under
    ``min_acceptance`` after at least ``min_samples`` proposals, the request
    skips ``base_skip * 2**failures`` steps (capped at ``max_skip``).
    """

    min_acceptance: float = 0.3
    min_samples: float = 4.0
    decay: float = 0.8
    base_skip: int = 4
    max_skip: int = 64
    _records: dict[str, _Record] = field(default_factory=dict)

    def should_propose(self, request_id: str) -> bool:
        record = self._records.get(request_id)
        if record is None or record.skip == 0:
            return True
        record.skip -= 1
        return False

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        record = self._records.setdefault(request_id, _Record())
        record.proposed = record.proposed * self.decay + proposed
        record.accepted = record.accepted * self.decay + accepted
        if record.proposed >= self.min_samples and record.accepted < self.min_acceptance * record.proposed:
            record.skip = min(self.max_skip, self.base_skip << record.failures)
            record.failures = min(record.failures + 1, 16)
            record.proposed = record.accepted = 0.0
        elif accepted:
            record.failures = 0

    def forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)
