"""Kernel tuning (SPEC section 9, issue 5): the search space (:mod:`.space`), the YAML database
(:mod:`.db`, with its strict field readers in :mod:`.fields`), its run-time lookup
(:mod:`.lookup`), the search loop (:mod:`.tuner`) and its GPU side (:mod:`.measure`,
:mod:`.compile`). ``snapmla tune`` is :mod:`snapmla_cli.cli.tune`.

This package file stays import-light (no torch): the compile workers of :mod:`.compile` import
it, and ``snapmla info`` reaches :func:`describe_database` through it.
"""

from __future__ import annotations

from typing import Any


def describe_database(gpus: list[Any]) -> list[str]:
    """Lines for ``snapmla info``: the folders searched and the entries that apply per GPU."""
    from .lookup import describe_database as describe

    return describe(gpus)


def survey_database(gpus: list[Any]) -> Any:
    """The same as a ``DatabaseSurvey`` (``as_dict()`` for ``snapmla info --json``)."""
    from .lookup import survey_database as survey

    return survey(gpus)


def matching_entries(gpu: Any) -> list[Any]:
    """Database entries for a ``GpuFacts``, a ``GpuKey`` or an NVML GPU name (user folder
    first); each has ``entry``, ``path``, ``origin`` and ``gpu``."""
    from .lookup import matching_entries as match

    return match(gpu)


__all__ = ["describe_database", "matching_entries", "survey_database"]
