import pytest

from inferd.gateway.config import HealthConfig
from inferd.gateway.replica import Replica

HEALTH = HealthConfig(failure_threshold=3, cooldown_s=10)


@pytest.fixture
def replica() -> Replica:
    return Replica(id="r0", url="http://127.0.0.1:9000", model="m", state="ready")


def fail(replica: Replica, now: float, times: int) -> None:
    for _ in range(times):
        replica.begin(now)
        replica.end(now, ok=False, health=HEALTH)


@pytest.mark.parametrize("state", ["starting", "unhealthy", "stopping"])
def test_only_ready_replicas_are_routable(state):
    replica = Replica(id="r0", url="http://x", model="m", state=state)

    assert replica.routable(0.0) is False


def test_ready_closed_replica_is_routable(replica):
    assert replica.routable(0.0) is True
    assert replica.circuit == "closed"


def test_failures_below_threshold_keep_it_routable(replica):
    fail(replica, 100.0, 2)

    assert replica.consecutive_failures == 2
    assert replica.open_until is None
    assert replica.routable(100.0) is True


def test_threshold_failure_opens_the_circuit(replica):
    fail(replica, 100.0, 3)

    assert replica.open_until == 110.0
    assert replica.circuit == "open"
    assert replica.routable(100.0) is False
    assert replica.routable(109.999) is False


def test_half_open_after_cooldown_allows_one_trial(replica):
    fail(replica, 100.0, 3)

    assert replica.routable(110.0) is True
    replica.begin(110.0)
    assert replica.trial_in_flight is True
    assert replica.routable(111.0) is False


def test_failed_trial_reopens_for_another_cooldown(replica):
    fail(replica, 100.0, 3)
    replica.begin(115.0)

    replica.end(116.0, ok=False, health=HEALTH)

    assert replica.trial_in_flight is False
    assert replica.consecutive_failures == 4
    assert replica.open_until == 126.0
    assert replica.routable(125.0) is False
    assert replica.routable(126.0) is True


def test_successful_trial_closes_and_resets(replica):
    fail(replica, 100.0, 3)
    replica.begin(115.0)

    replica.end(116.0, ok=True, health=HEALTH)

    assert replica.trial_in_flight is False
    assert replica.consecutive_failures == 0
    assert replica.open_until is None
    assert replica.circuit == "closed"
    assert replica.routable(116.0) is True


def test_success_resets_the_failure_count(replica):
    fail(replica, 100.0, 2)
    replica.begin(101.0)
    replica.end(101.0, ok=True, health=HEALTH)
    fail(replica, 102.0, 2)

    assert replica.consecutive_failures == 2
    assert replica.open_until is None


def test_begin_on_a_closed_circuit_is_no_trial(replica):
    replica.begin(5.0)

    assert replica.trial_in_flight is False
    assert (replica.in_flight, replica.served, replica.last_active) == (1, 1, 5.0)


def test_end_releases_and_never_goes_negative(replica):
    replica.end(7.0, ok=True, health=HEALTH)

    assert replica.in_flight == 0
    assert replica.last_active == 7.0


@pytest.mark.parametrize(("in_flight", "upstream_load", "load"), [(0, 0, 0), (3, 1, 3), (1, 5, 5)])
def test_load_is_the_larger_of_in_flight_and_upstream(replica, in_flight, upstream_load, load):
    replica.in_flight, replica.upstream_load = in_flight, upstream_load

    assert replica.load == load


def test_idle_for_counts_from_last_activity(replica):
    replica.begin(10.0)

    assert replica.idle_for(50.0) == 0.0
    replica.end(12.0, ok=True, health=HEALTH)
    assert replica.idle_for(50.0) == 38.0
