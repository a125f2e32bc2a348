"""GPU metrics: none on CPU; on GPUs, what NVML reports.

This machine has no GPU, so the NVML side is exercised with a stand-in
module holding NVML's four calls and its result shapes."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from inferd.obs.gpu import NVMLCollector, nvml_collector
from inferd.obs.metrics import ServerMetrics


def test_a_cpu_server_exports_no_gpu_metrics():
    assert nvml_collector("cpu") is None
    text = ServerMetrics("m", device_type="cpu").exposition().decode()
    assert "gpu" not in text and "inferd:num_requests_running" in text


class _NVML:
    def __init__(self, broken: int | None = None) -> None:
        self.broken = broken

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - NVML's names
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:  # noqa: N802
        if handle == self.broken:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=40 + handle, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30, free=0)


def test_nvml_readings_become_per_gpu_gauges():
    registry = CollectorRegistry()
    registry.register(NVMLCollector(_NVML()))
    assert registry.get_sample_value("inferd:gpu_utilization_perc", {"gpu": "1"}) == 0.41
    assert registry.get_sample_value("inferd:gpu_memory_used_bytes", {"gpu": "0"}) == 2**30
    assert registry.get_sample_value("inferd:gpu_memory_total_bytes", {"gpu": "1"}) == 80 * 2**30


def test_a_failing_gpu_is_skipped_not_fatal():
    registry = CollectorRegistry()
    registry.register(NVMLCollector(_NVML(broken=0)))
    text = generate_latest(registry).decode()
    assert 'gpu="1"' in text and 'gpu="0"' not in text
