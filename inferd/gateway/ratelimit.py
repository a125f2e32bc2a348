"""Per-key rate limits for ``inferd gateway``: requests, tokens and concurrency.

Each limited key gets one token bucket per per-minute limit (``requests`` for
rpm, ``tokens`` for tpm) and an in-flight count. Buckets refill continuously,
so a key that used its whole minute at once gets capacity back a little at a
time rather than all at the top of the next minute.

Prompt tokens are known before generation and taken at admission; completion
tokens are only known as they stream, so they are charged afterwards and may
drive the tokens bucket below zero. The key's next requests then wait until
the debt is paid off, which keeps the long-run rate at tpm.

Pure Python, no locks: everything runs on the gateway's one event loop.
Time comes from an injected clock so tests step it instead of sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

REQUESTS = "requests"
TOKENS = "tokens"
CONCURRENCY = "concurrency"
REASONS = (REQUESTS, TOKENS, CONCURRENCY)

# How often admit() sweeps out idle buckets; a sweep is O(buckets).
PRUNE_EVERY = 1000
# A concurrency refusal has no bucket to compute a wait from: the slot frees
# when some other request finishes, so suggest a short, fixed retry.
CONCURRENCY_RETRY_S = 1.0
# A prompt larger than tpm never fits; Retry-After still needs a value.
OVERSIZED_RETRY_S = 60.0


def _check_limit(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")


def _check_capacity(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {value!r}")


def _check_amount(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def _ceil(x: float, scale: float = 1.0) -> int:
    # Round away float noise first: 0.85 s of refill can come out as
    # 850.0000000001 ms, which a bare ceil would report as 851ms.
    return math.ceil(round(x * scale, 6))


@dataclass(frozen=True)
class RateLimits:
    rpm: int | None = None  # requests per minute; None = unlimited
    tpm: int | None = None  # tokens per minute, prompt + completion
    max_concurrent: int | None = None  # requests in flight at once

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_limit(f.name, getattr(self, f.name))

    def merged(self, override: RateLimits) -> RateLimits:
        """These limits with every field that ``override`` sets replaced."""
        changes = {
            f.name: getattr(override, f.name)
            for f in fields(override)
            if getattr(override, f.name) is not None
        }
        return replace(self, **changes)


class TokenBucket:
    """capacity tokens, refilled continuously at capacity/60 per second (a
    per-minute limit), starting full.

    Invariant: ``level <= capacity``; it may go below zero after charge().
    Waits are computed as ``deficit * 60 / capacity`` rather than
    ``deficit / rate`` so round limits give exact seconds (rpm 1 -> 60.0).
    """

    def __init__(self, capacity: int, now: float) -> None:
        _check_capacity(capacity)
        self.capacity = capacity
        self._level = float(capacity)
        self._last = now

    def _refill(self, now: float) -> None:
        # A clock that steps back (it should not: monotonic) refills nothing.
        elapsed = max(0.0, now - self._last)
        self._level = min(float(self.capacity), self._level + elapsed * self.capacity / 60.0)
        self._last = max(self._last, now)

    def available(self, now: float) -> float:
        self._refill(now)
        return self._level

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken; 0.0 if it can be now.

        An amount above capacity is never takeable; the answer is then the
        time until the level would reach it if the bucket had no cap, and the
        caller has to refuse such amounts itself.
        """
        _check_amount("amount", amount)
        self._refill(now)
        deficit = amount - self._level
        return 0.0 if deficit <= 0 else deficit * 60.0 / self.capacity

    def try_take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0.0, or take nothing and return the wait."""
        wait = self.seconds_until(amount, now)
        if wait == 0.0:
            self._level -= amount
        return wait

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` unconditionally: the tokens were already produced."""
        _check_amount("amount", amount)
        self._refill(now)
        self._level -= amount

    def seconds_until_full(self, now: float) -> float:
        self._refill(now)
        return (self.capacity - self._level) * 60.0 / self.capacity

    def resize(self, capacity: int, now: float) -> None:
        """Change the capacity, keeping the fill fraction (debt scales too)."""
        _check_capacity(capacity)
        self._refill(now)
        fraction = self._level / self.capacity
        self.capacity = capacity
        self._level = fraction * capacity


def format_duration(seconds: float) -> str:
    """OpenAI's reset-header style: "850ms", "1s", "1.5s", "1m30s", "6m0s", "1h0m0s".

    Rounded up to the millisecond so a client that waits this long finds the
    bucket full.
    """
    total_ms = max(0, _ceil(seconds, 1000.0))
    if total_ms < 1000:
        return f"{total_ms}ms" if total_ms else "0s"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, sec_ms = divmod(rest_ms, 60_000)
    secs = f"{sec_ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _format_wait(seconds: float) -> str:
    # Tenths, rounded up, so the message never says "retry in 0.0s".
    return f"{_ceil(seconds, 10.0) / 10:.1f}s"


class RateLimited(Exception):
    """A request refused by a limit; the gateway turns it into a 429."""

    def __init__(
        self, reason: str, message: str, retry_after_s: float, headers: dict[str, str]
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        # Retry-After is whole seconds (RFC 9110); 0 would invite a busy loop.
        self.headers = {**headers, "Retry-After": str(max(1, _ceil(retry_after_s)))}


@dataclass
class Admission:
    key_id: str
    prompt_tokens: int
    headers: dict[str, str]  # the x-ratelimit-* headers for the successful response


class RateLimiter:
    """Token buckets and in-flight counts per key."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, prune_every: int = PRUNE_EVERY
    ) -> None:
        _check_limit("prune_every", prune_every)
        self._clock = clock
        self._prune_every = prune_every
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        # Only keys with requests in flight have an entry (never 0).
        self._in_flight: dict[str, int] = {}
        self._admits_since_prune = 0

    def _bucket(self, key_id: str, kind: str, capacity: int, now: float) -> TokenBucket:
        bucket = self._buckets.get((key_id, kind))
        if bucket is None:
            bucket = self._buckets[(key_id, kind)] = TokenBucket(capacity, now)
        elif bucket.capacity != capacity:
            bucket.resize(capacity, now)
        return bucket

    def admit(self, key_id: str, limits: RateLimits, prompt_tokens: int) -> Admission:
        """Admit one request or raise RateLimited; all or nothing."""
        bad = isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int)
        if bad or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        now = self._clock()
        self._admits_since_prune += 1
        if self._admits_since_prune >= self._prune_every:
            self._admits_since_prune = 0
            self.prune(now)

        if limits.max_concurrent is not None and self.in_flight(key_id) >= limits.max_concurrent:
            raise RateLimited(
                CONCURRENCY,
                f"rate limit reached: {limits.max_concurrent} requests in flight at once; "
                "retry when one of them finishes",
                CONCURRENCY_RETRY_S,
                self.headers(key_id, limits),
            )
        # Check every bucket before taking from any, so a refusal costs nothing.
        requests = tokens = None
        if limits.rpm is not None:
            requests = self._bucket(key_id, REQUESTS, limits.rpm, now)
            wait = requests.seconds_until(1, now)
            if wait > 0:
                raise RateLimited(
                    REQUESTS,
                    f"rate limit reached: {limits.rpm} requests per minute; "
                    f"retry in {_format_wait(wait)}",
                    wait,
                    self.headers(key_id, limits),
                )
        if limits.tpm is not None:
            tokens = self._bucket(key_id, TOKENS, limits.tpm, now)
            if prompt_tokens > limits.tpm:
                raise RateLimited(
                    TOKENS,
                    f"prompt is {prompt_tokens} tokens, more than the limit of {limits.tpm} "
                    "tokens per minute: it will not pass however long you wait; "
                    "shorten the prompt or ask for a higher limit",
                    OVERSIZED_RETRY_S,
                    self.headers(key_id, limits),
                )
            wait = tokens.seconds_until(prompt_tokens, now)
            if wait > 0:
                raise RateLimited(
                    TOKENS,
                    f"rate limit reached: {limits.tpm} tokens per minute (prompt + completion); "
                    f"retry in {_format_wait(wait)}",
                    wait,
                    self.headers(key_id, limits),
                )
        if requests is not None:
            taken = requests.try_take(1, now)
            assert taken == 0.0, "checked above at the same instant"
        if tokens is not None:
            taken = tokens.try_take(prompt_tokens, now)
            assert taken == 0.0, "checked above at the same instant"
        self._in_flight[key_id] = self.in_flight(key_id) + 1
        return Admission(key_id, prompt_tokens, self.headers(key_id, limits))

    def charge(self, key_id: str, tokens: int) -> None:
        """Charge completion tokens as they stream; no-op for a key without tpm."""
        _check_amount("tokens", tokens)
        bucket = self._buckets.get((key_id, TOKENS))
        if bucket is not None:
            bucket.charge(tokens, self._clock())

    def release(self, key_id: str) -> None:
        """The request finished, however it ended."""
        count = self._in_flight.get(key_id, 0)
        if count <= 1:
            self._in_flight.pop(key_id, None)
        else:
            self._in_flight[key_id] = count - 1

    def in_flight(self, key_id: str) -> int:
        return self._in_flight.get(key_id, 0)

    def headers(self, key_id: str, limits: RateLimits) -> dict[str, str]:
        """The x-ratelimit-* headers, only for the limits that are set."""
        now = self._clock()
        out: dict[str, str] = {}
        for kind, capacity in ((REQUESTS, limits.rpm), (TOKENS, limits.tpm)):
            if capacity is None:
                continue
            bucket = self._bucket(key_id, kind, capacity, now)
            out[f"x-ratelimit-limit-{kind}"] = str(capacity)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.available(now))))
            out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.seconds_until_full(now))
        return out

    def prune(self, now: float) -> int:
        """Drop full buckets of keys with nothing in flight; return how many.

        Lossless: a dropped bucket was full, and a bucket made again later
        starts full, whatever its capacity.
        """
        idle_full = [
            k
            for k, bucket in self._buckets.items()
            if k[0] not in self._in_flight and bucket.seconds_until_full(now) == 0.0
        ]
        for k in idle_full:
            del self._buckets[k]
        return len(idle_full)

    def bucket_count(self) -> int:
        return len(self._buckets)
