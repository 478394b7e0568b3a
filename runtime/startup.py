"""Start-up is part of latency: seconds from this process's start to a moment of the engine's
life (loaded: weights uploaded, kernels loaded, graphs captured; first token on the host).

The start is the kernel's record of when the process began (Linux's /proc/self/stat), so the
interpreter's start and every import count. Where there is no /proc, the clock starts when
this module is first imported, which leaves out what ran before it.
"""
from __future__ import annotations

import os
import time

_IMPORTED = time.monotonic()


def _started_since_boot() -> float | None:
    """When this process started, in seconds since boot (None without /proc)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces; field 22 (starttime,
    # clock ticks since boot) is the 20th after it.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


_STARTED = _started_since_boot()


def process_age() -> float:
    """Seconds since this process started (to the clock tick, 10 ms on most Linux systems)."""
    if _STARTED is None:
        return time.monotonic() - _IMPORTED
    return time.clock_gettime(time.CLOCK_BOOTTIME) - _STARTED
