"""The Grafana dashboard queries only metrics a running server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "inferd.json"
_METRIC = re.compile(r"\b((?:inferd:|process_)[a-z0-9_]+)")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def test_every_queried_metric_is_exported(http):
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})  # so every family has samples
    exported = set()
    for family in text_string_to_metric_families(http.get("/metrics").text):
        exported.update(s.name for s in family.samples)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {m for p in dashboard["panels"] for t in p["targets"] for m in _METRIC.findall(t["expr"])}
    assert len(queried) >= 15
    missing = sorted(m for m in queried if m not in exported)
    assert not missing, f"the dashboard queries metrics no server exports: {missing}"
    # The label the dashboard filters on is on every inferd metric.
    text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("inferd:"):
            assert 'model_name="smol"' in line, line
    assert all(p["targets"] and p["title"] for p in dashboard["panels"])
