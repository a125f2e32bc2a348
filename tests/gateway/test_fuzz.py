"""The gateway's OpenAPI document fuzzed with schemathesis against real
replicas: whatever the generated request, no 5xx (a bounded run)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from inferd.gateway.config import GatewayConfig
from inferd.gateway.keys import KeyStore
from tests.gateway.conftest import LiveGateway, smol


@pytest.fixture(scope="module")
def fuzzed_gateway(replicas, tmp_path_factory) -> Iterator[tuple[LiveGateway, str]]:
    data = tmp_path_factory.mktemp("fuzz")
    store = KeyStore(data / "gateway.db")
    key, _ = store.create("fuzz")
    # Small caps keep each generated request cheap; they are part of what is fuzzed.
    model = smol([r.url for r in replicas], max_tokens=4, max_prompt_tokens=256, tokenizer="default")
    live = LiveGateway(GatewayConfig(models=[model], data_dir=str(data))).start()
    live.wait_ready("smol", 2)
    yield live, key
    live.stop()
    store.close()


# Generated requests per operation: bounded, and derandomized so a failure reproduces.
EXAMPLES = 30


def test_no_generated_request_gets_a_5xx(fuzzed_gateway):
    live, key = fuzzed_gateway
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    headers = {"Authorization": f"Bearer {key}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def fuzz(case) -> None:  # noqa: ANN001
            case.call_and_validate(base_url=live.url, headers=headers, checks=[not_a_server_error], timeout=120)

        fuzz()
    # Some generated requests passed the edge and went all the way to a replica.
    forwarded = live.gateway.metrics.first_byte.labels("smol")
    assert sum(bucket.get() for bucket in forwarded._buckets) > 0
