import pytest

from inferd.gateway.ratelimit import (
    Admission,
    RateLimited,
    RateLimiter,
    RateLimits,
    TokenBucket,
    format_duration,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def limiter(clock):
    return RateLimiter(clock=clock)


# RateLimits


@pytest.mark.parametrize("field", ["rpm", "tpm", "max_concurrent"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "10"])
def test_limits_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be None or an integer >= 1"):
        RateLimits(**{field: value})


def test_limits_default_to_unlimited():
    assert RateLimits() == RateLimits(rpm=None, tpm=None, max_concurrent=None)


def test_merged_takes_the_fields_the_override_sets():
    base = RateLimits(rpm=60, tpm=1000, max_concurrent=4)
    assert base.merged(RateLimits(tpm=50)) == RateLimits(rpm=60, tpm=50, max_concurrent=4)
    assert base.merged(RateLimits()) == base
    assert RateLimits().merged(base) == base


# TokenBucket


def test_bucket_starts_full_and_refills_at_capacity_per_minute():
    bucket = TokenBucket(60, now=0.0)
    assert bucket.available(0.0) == 60.0
    for _ in range(60):
        assert bucket.try_take(1, 0.0) == 0.0
    assert bucket.available(0.0) == 0.0
    assert bucket.try_take(1, 0.0) == 1.0
    assert bucket.available(0.5) == 0.5
    assert bucket.try_take(1, 0.5) == 0.5
    assert bucket.available(0.5) == 0.5  # a refused take takes nothing
    assert bucket.try_take(1, 1.0) == 0.0
    assert bucket.available(1.0) == 0.0
    assert bucket.seconds_until_full(1.0) == 60.0
    assert bucket.available(1000.0) == 60.0  # capped at capacity


def test_bucket_charge_goes_negative_and_waits_are_deficit_over_rate():
    bucket = TokenBucket(600, now=0.0)  # 10 tokens per second
    bucket.charge(700, 0.0)
    assert bucket.available(0.0) == -100.0
    assert bucket.try_take(0, 0.0) == 10.0
    assert bucket.try_take(50, 0.0) == 15.0
    assert bucket.seconds_until_full(0.0) == 70.0
    assert bucket.available(10.0) == 0.0


def test_bucket_rpm_1_waits_a_whole_minute_exactly():
    bucket = TokenBucket(1, now=0.0)
    assert bucket.try_take(1, 0.0) == 0.0
    assert bucket.try_take(1, 0.0) == 60.0
    assert bucket.try_take(1, 60.0) == 0.0


def test_bucket_resize_keeps_fill_fraction():
    bucket = TokenBucket(100, now=0.0)
    bucket.charge(75, 0.0)
    bucket.resize(200, 0.0)
    assert (bucket.capacity, bucket.available(0.0)) == (200, 50.0)


@pytest.mark.parametrize("capacity", [0, -5, True, 2.0, None])
def test_bucket_rejects_bad_capacity(capacity):
    with pytest.raises(ValueError, match="^capacity"):
        TokenBucket(capacity, now=0.0)


# Header formatting


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-3.0, "0s"),
        (0.85, "850ms"),
        (0.0004, "1ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (90.0, "1m30s"),
        (360.0, "6m0s"),
        (3600.0, "1h0m0s"),
        (59.9999, "1m0s"),
    ],
)
def test_format_duration_like_openai(seconds, text):
    assert format_duration(seconds) == text


# RateLimiter: requests


def test_burst_of_rpm_plus_one_refuses_exactly_the_last(limiter):
    limits = RateLimits(rpm=60)
    for i in range(60):
        admission = limiter.admit("k", limits, prompt_tokens=10)
        limiter.release("k")
    assert admission == Admission(
        "k",
        10,
        {
            "x-ratelimit-limit-requests": "60",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1m0s",
        },
    )
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, prompt_tokens=10)
    err = exc.value
    assert err.reason == "requests"
    assert err.retry_after_s == 1.0
    assert str(err) == "rate limit reached: 60 requests per minute; retry in 1.0s"
    assert err.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "Retry-After": "1",
    }
    assert limiter.in_flight("k") == 0


def test_requests_refill_half_then_whole(limiter, clock):
    limits = RateLimits(rpm=60)
    for _ in range(60):
        limiter.admit("k", limits, 0)
    clock.advance(0.5)
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, 0)
    assert exc.value.retry_after_s == 0.5
    assert exc.value.headers["Retry-After"] == "1"
    assert str(exc.value) == "rate limit reached: 60 requests per minute; retry in 0.5s"
    clock.advance(0.5)
    assert limiter.admit("k", limits, 0).headers["x-ratelimit-remaining-requests"] == "0"


def test_reset_header_in_milliseconds(limiter, clock):
    limits = RateLimits(rpm=60)
    limiter.admit("k", limits, 0)
    clock.advance(0.15)
    assert limiter.headers("k", limits) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "850ms",
    }


def test_keys_are_limited_separately(limiter):
    limits = RateLimits(rpm=1)
    limiter.admit("a", limits, 0)
    limiter.admit("b", limits, 0)
    with pytest.raises(RateLimited):
        limiter.admit("a", limits, 0)


# RateLimiter: tokens


def test_completion_charged_after_drives_next_request_to_wait(limiter, clock):
    limits = RateLimits(tpm=600)  # 10 tokens per second
    admission = limiter.admit("k", limits, prompt_tokens=100)
    assert admission.headers == {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "10s",
    }
    limiter.charge("k", 300)
    limiter.charge("k", 400)
    limiter.release("k")
    # level 600 - 100 - 700 = -200; the next prompt of 100 needs 300 more.
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, prompt_tokens=100)
    err = exc.value
    assert (err.reason, err.retry_after_s) == ("tokens", 30.0)
    assert str(err) == (
        "rate limit reached: 600 tokens per minute (prompt + completion); retry in 30.0s"
    )
    assert err.headers == {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1m20s",
        "Retry-After": "30",
    }
    clock.advance(30.0)
    headers = limiter.admit("k", limits, prompt_tokens=100).headers
    assert headers["x-ratelimit-remaining-tokens"] == "0"


def test_prompt_larger_than_tpm_never_passes(limiter):
    limits = RateLimits(tpm=1000)
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, prompt_tokens=1001)
    err = exc.value
    assert (err.reason, err.retry_after_s, err.headers["Retry-After"]) == ("tokens", 60.0, "60")
    assert str(err) == (
        "prompt is 1001 tokens, more than the limit of 1000 tokens per minute: "
        "it will not pass however long you wait; shorten the prompt or ask for a higher limit"
    )
    headers = limiter.admit("k", limits, prompt_tokens=1000).headers
    assert headers["x-ratelimit-remaining-tokens"] == "0"


def test_tokens_refusal_leaves_requests_bucket_untouched(limiter):
    limits = RateLimits(rpm=10, tpm=100)
    limiter.admit("k", limits, prompt_tokens=80)
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, prompt_tokens=30)
    assert exc.value.reason == "tokens"
    assert exc.value.headers["x-ratelimit-remaining-requests"] == "9"
    assert limiter.headers("k", limits)["x-ratelimit-remaining-requests"] == "9"
    assert limiter.in_flight("k") == 1


def test_charge_without_tpm_is_a_noop(limiter):
    limiter.admit("k", RateLimits(rpm=5), 10)
    limiter.charge("k", 10_000)
    limiter.charge("never-seen", 10)
    assert limiter.headers("k", RateLimits(rpm=5))["x-ratelimit-remaining-requests"] == "4"


def test_tpm_change_rebuilds_bucket_keeping_fraction(limiter):
    limiter.admit("k", RateLimits(tpm=1000), prompt_tokens=250)
    headers = limiter.headers("k", RateLimits(tpm=2000))
    assert headers["x-ratelimit-remaining-tokens"] == "1500"
    assert headers["x-ratelimit-limit-tokens"] == "2000"


# RateLimiter: concurrency


def test_concurrency_cap_and_release(limiter):
    limits = RateLimits(max_concurrent=2)
    limiter.admit("k", limits, 0)
    limiter.admit("k", limits, 0)
    assert limiter.in_flight("k") == 2
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, 0)
    err = exc.value
    assert (err.reason, err.retry_after_s) == ("concurrency", 1.0)
    assert err.headers == {"Retry-After": "1"}
    assert str(err) == (
        "rate limit reached: 2 requests in flight at once; retry when one of them finishes"
    )
    limiter.release("k")
    limiter.admit("k", limits, 0)
    for _ in range(5):
        limiter.release("k")
    assert limiter.in_flight("k") == 0


def test_concurrency_refusal_takes_no_request(limiter):
    limits = RateLimits(rpm=5, max_concurrent=1)
    limiter.admit("k", limits, 0)
    with pytest.raises(RateLimited) as exc:
        limiter.admit("k", limits, 0)
    assert exc.value.headers["x-ratelimit-remaining-requests"] == "4"


# Unlimited


def test_unlimited_never_refuses_and_sends_no_headers(limiter):
    for _ in range(5000):
        assert limiter.admit("k", RateLimits(), prompt_tokens=10**6).headers == {}
    limiter.charge("k", 10**9)
    assert limiter.headers("k", RateLimits()) == {}
    assert limiter.in_flight("k") == 5000


def test_admit_rejects_bad_prompt_tokens(limiter):
    with pytest.raises(ValueError, match="^prompt_tokens"):
        limiter.admit("k", RateLimits(), -1)


# Prune


def test_prune_drops_only_full_buckets_of_idle_keys(limiter, clock):
    limits = RateLimits(rpm=60, tpm=600)
    limiter.admit("idle", limits, 10)
    limiter.release("idle")
    limiter.admit("busy", limits, 10)
    limiter.headers("fresh", limits)  # full from the start
    assert limiter.bucket_count() == 6
    assert limiter.prune(clock()) == 2  # fresh's two
    clock.advance(1.0)  # idle's tokens bucket is full again; its requests bucket too
    assert limiter.prune(clock()) == 2
    assert limiter.bucket_count() == 2  # busy keeps both while in flight
    limiter.release("busy")
    clock.advance(59.0)
    assert limiter.prune(clock()) == 2
    assert limiter.bucket_count() == 0


def test_prune_keeps_partly_drained_buckets(limiter, clock):
    limiter.admit("k", RateLimits(rpm=60), 0)
    limiter.release("k")
    clock.advance(0.5)
    assert limiter.prune(clock()) == 0


def test_admit_prunes_every_n_admissions(clock):
    limiter = RateLimiter(clock=clock, prune_every=3)
    limits = RateLimits(rpm=60)
    limiter.headers("a", limits)
    limiter.headers("b", limits)
    limiter.admit("c", limits, 0)
    limiter.admit("c", limits, 0)
    assert limiter.bucket_count() == 3
    limiter.admit("c", limits, 0)  # the third: a and b are full and idle
    assert limiter.bucket_count() == 1
