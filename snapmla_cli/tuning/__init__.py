"""Kernel tuning (SPEC section 9, issue 5): the search space (:mod:`.space`), the YAML database
(:mod:`.db`, with its strict field readers in :mod:`.fields`), its run-time lookup
(:mod:`.lookup`), the search loop (:mod:`.tuner`) and its GPU side (:mod:`.measure`,
:mod:`.compile`). ``snapmla tune`` is :mod:`snapmla_cli.cli.tune`.

This package file stays import-light (no torch): the compile workers of :mod:`.compile` import
it, and ``snapmla info`` reaches :func:`survey_database` and :func:`describe_survey` through it.
"""

from __future__ import annotations

from typing import Any


def describe_database(gpus: list[Any]) -> list[str]:
    """Lines for ``snapmla info``: the folders searched and the entries that apply per GPU."""
    from .lookup import describe_database as describe

    return describe(gpus)


def survey_database(gpus: list[Any], kernels: str | None) -> Any:
    """The same as a ``DatabaseSurvey``, its stale marks against the stamp ``kernels``:
    :func:`describe_survey` renders its lines, ``as_dict()`` is ``snapmla info --json``'s."""
    from .lookup import survey_database as survey

    return survey(gpus, kernels)


def describe_survey(survey: Any) -> list[str]:
    """The lines of :func:`describe_database` for a survey already made."""
    from .lookup import describe_survey as describe

    return describe(survey)


def matching_entries(gpu: Any) -> list[Any]:
    """Database entries for a ``GpuFacts``, a ``GpuKey`` or an NVML GPU name (user folder
    first); each has ``entry``, ``path``, ``origin`` and ``gpu``."""
    from .lookup import matching_entries as match

    return match(gpu)


__all__ = ["describe_database", "describe_survey", "matching_entries", "survey_database"]
