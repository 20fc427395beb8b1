"""This process's memory between build stages: its peak so far, handing freed memory back to the OS, and
what the machine has available."""

from __future__ import annotations


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_memory() -> None:
    """Hand memory a finished stage freed back to the OS, so the next stage starts lean."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def available_bytes() -> int | None:
    """The kernel's MemAvailable, or None where /proc/meminfo cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
