"""On / off switches read from environment variables (``SNAPMLA_CHECK_FINITE``, ``SNAPMLA_PDL``,
``SNAPMLA_CLUSTER_FOLD``, ``SNAPMLA_TRACEBACK``).

One parser for all of them: each used to read its variable its own way, so that
``SNAPMLA_CHECK_FINITE=false`` turned the checks *on* (anything but "0" did) and
``SNAPMLA_PDL=off`` left the programmatic launch on (only "0" turned it off). A value that is
neither on nor off keeps the default and warns once, naming the variable."""

from __future__ import annotations

import os
import warnings

from .errors import show

ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("0", "false", "no", "off")

_warned: set[tuple[str, str]] = set()


def env_switch(name: str, default: bool) -> bool:
    """The switch ``name``: True for 1 / true / yes / on, False for 0 / false / no / off (any
    case, surrounding blanks ignored), ``default`` when unset or empty, and ``default`` with a
    warning for anything else (a switch read on the hot path must not raise)."""
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    if value and (name, value) not in _warned:
        _warned.add((name, value))
        warnings.warn(f"{name}={show(raw)} is neither on ({' / '.join(ON_VALUES)}) nor off ({' / '.join(OFF_VALUES)}): "
                      f"taken as {'on' if default else 'off'}, the default", stacklevel=2)
    return default
