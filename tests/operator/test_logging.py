"""Operator log hygiene: what Kopf would print once per object per second stays out."""

from __future__ import annotations

import logging

from ember_operator.handlers import QuietTimerSuccess


def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)


def test_timer_successes_are_dropped_everything_else_passes() -> None:
    quiet = QuietTimerSuccess()
    assert not quiet.filter(_record(logging.INFO, "Timer 'thermal' succeeded."))
    assert not quiet.filter(_record(logging.INFO, "Timer 'resync' succeeded."))
    assert quiet.filter(_record(logging.INFO, "Handler 'create' succeeded."))
    assert quiet.filter(_record(logging.INFO, "thermal: tainted node-a"))
    assert quiet.filter(_record(logging.ERROR, "Timer 'thermal' failed with an exception."))


def test_the_filter_is_installed_on_kopfs_object_logger() -> None:
    filters = logging.getLogger("kopf.objects").filters
    assert any(isinstance(f, QuietTimerSuccess) for f in filters)
