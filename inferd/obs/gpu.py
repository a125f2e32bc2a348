"""GPU utilisation and memory through NVML, when a GPU is there.

``pynvml`` comes from the optional ``nvidia-ml-py`` package
(``pip install 'inferd[gpu]'``); without it, or without a GPU, no GPU
metrics are exported and nothing fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class NVMLCollector(Collector):
    """Reads every visible GPU at scrape time."""

    def __init__(self, nvml: Any) -> None:  # noqa: ANN401 - the pynvml module
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util = GaugeMetricFamily("inferd:gpu_utilization_perc", "GPU busy fraction over the last sample period, 0 to 1.", labels=["gpu"])
        used = GaugeMetricFamily("inferd:gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"])
        total = GaugeMetricFamily("inferd:gpu_memory_total_bytes", "GPU memory in all.", labels=["gpu"])
        for i, handle in enumerate(self._handles):
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as e:  # noqa: BLE001 - a GPU gone bad must not break the scrape
                logger.warning("NVML read of GPU %d failed: %s", i, e)
                continue
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], float(memory.used))
            total.add_metric([str(i)], float(memory.total))
        yield from (util, used, total)


def nvml_collector(device_type: str) -> NVMLCollector | None:
    """A collector for the GPUs when ``device_type`` is ``cuda`` and NVML
    answers; else None."""
    if device_type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return NVMLCollector(pynvml)
    except Exception as e:  # noqa: BLE001 - no NVML: no GPU metrics, said once
        logger.info("no GPU metrics: NVML unavailable (%s)", e)
        return None
