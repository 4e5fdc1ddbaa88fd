"""The fields every JSON report of snapmla opens with (bench, info, quantize, verify).

A report is archived and compared later ("was FP8 safe for this model with the kernels of last
month?"), so each names its layout (``format`` and ``version``, bumped when a field changes
meaning or goes away) and what produced it: the package's version and the hash of the kernel
sources, the same hash the tuning database's entries are stamped with.
"""

from __future__ import annotations

# the version of the JSON reports' layout, shared by all of them
REPORT_VERSION = "1"


def report_header(name: str, stamp: tuple[str | None, str] | None = None) -> dict[str, str | None]:
    """``{"format": name, "version", "snapmla_version", "kernel_sources"}``; ``kernel_sources`` is
    None where the kernel folder cannot be read (the report says what it measured, not why the
    hash is missing: ``snapmla info`` does). ``stamp``: ``nvrtc.kernel_sources_stamp()`` if the
    caller has read it already, else it is read here."""
    from . import __version__
    from .runtime.nvrtc import kernel_sources_stamp

    digest, _why = stamp if stamp is not None else kernel_sources_stamp()
    return {"format": name, "version": REPORT_VERSION, "snapmla_version": __version__, "kernel_sources": digest}
