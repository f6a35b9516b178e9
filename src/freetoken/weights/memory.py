"""How much host memory is free, for checks made before loading anything."""

from __future__ import annotations

import os


def available_host_bytes() -> int:
    """Memory the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
