"""Per-request sampling parameters, validated on construction.

Field names and defaults follow vLLM's ``SamplingParams`` (itself a superset of
OpenAI's request fields), so code written against either carries over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> additive bias, in [-100, 100] as OpenAI allows.
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    # None: generate until a stop criterion or the model's context length.
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of top alternatives to return beside each chosen token's logprob;
    # None returns no logprobs, 0 only the chosen token's.
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=0)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                try:
                    token_id = int(token)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}") from None
                _check_number(f"logit_bias[{token_id}]", value)
                if not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {value}")
                bias[token_id] = float(value)
            self.logit_bias = bias
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def child(self, index: int) -> SamplingParams:
        """The params of the ``index``-th of ``n`` parallel samples.

        Each child gets its own seed so seeded ``n > 1`` requests give n
        different yet reproducible samples.
        """
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
