"""Running ``inferd serve`` as a subprocess for the serving benchmarks."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

LOG_TAIL_CHARS = 4000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no server log)"


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``/health`` until 200; fail if the server exits or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            r = httpx.get(f"{base_url}/health", timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f}s (last /health: {last})")


def _status_mb(pid: int, field: str) -> float | None:
    """A memory field (kB) of a live process's /proc status, in MB (Linux only)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def vm_hwm_mb(pid: int) -> float | None:
    """A live process's peak RSS."""
    return _status_mb(pid, "VmHWM")


def vm_rss_mb(pid: int) -> float | None:
    """A live process's current RSS."""
    return _status_mb(pid, "VmRSS")


def stop_server(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)
