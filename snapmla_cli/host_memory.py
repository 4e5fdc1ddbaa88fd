"""How much host memory a command may take, so that a size typed with one zero too many fails at
once with its option's name instead of after minutes of swapping or as a torch allocation error."""

from __future__ import annotations

from pathlib import Path

from .errors import SnapmlaError

MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (Linux ``MemAvailable``);
    None where it cannot be read, and then no check is made."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_host_memory(what: str, needed_bytes: int) -> None:
    """A one-line error naming ``what`` when it needs more host memory than is available."""
    available = available_bytes()
    if available is not None and needed_bytes > available:
        raise SnapmlaError(f"{what}: needs about {_gib(needed_bytes)} GiB of host memory, "
                           f"{available / 2**30:,.1f} GiB available")


def _gib(size: int) -> str:
    """``size`` in GiB to three digits, 79,473 rather than ``.3g``'s 7.95e+04 for the huge
    sizes a mistyped option asks for, and a power of ten past a billion GiB."""
    whole = size >> 30
    if whole >= 10**9:  # (a count with hundreds of digits: its float overflowed, an internal error)
        return f"10^{len(str(whole)) - 1}"
    gib = size / 2**30
    return f"{gib:,.0f}" if gib >= 1000 else f"{gib:.3g}"
