"""Resident memory of a server process: current RSS and lifetime peak (bytes).

Linux reads /proc/PID/status (VmRSS, VmHWM); elsewhere psutil when installed, else `ps` (which
has no peak, so the peak is the largest RSS this module has sampled).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySample:
    """One reading; `peak_bytes` is the kernel's high-water mark where the OS has one."""

    rss_bytes: int
    peak_bytes: int
    source: str  # "proc" | "psutil" | "ps"


def _proc_status(pid: int) -> MemorySample | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    rss = int(fields["VmRSS"].split()[0]) * 1024  # values are in kB
    peak = int(fields["VmHWM"].split()[0]) * 1024
    return MemorySample(rss, peak, "proc")


def _psutil(pid: int) -> MemorySample | None:
    try:
        import psutil
    except ImportError:
        return None
    info = psutil.Process(pid).memory_info()
    peak = getattr(info, "peak_wset", None) or info.rss  # no portable peak in psutil
    return MemorySample(info.rss, max(peak, info.rss), "psutil")


def _ps(pid: int) -> MemorySample:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    rss = int(out.stdout.strip() or 0) * 1024
    return MemorySample(rss, rss, "ps")


def sample(pid: int) -> MemorySample:
    """Current RSS and peak RSS of `pid` (bytes)."""
    if sys.platform.startswith("linux"):
        found = _proc_status(pid)
        if found is not None:
            return found
    return _psutil(pid) or _ps(pid)
