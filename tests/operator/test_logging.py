"""Operator log hygiene: what Kopf would print on every watch event stays out."""

from __future__ import annotations

import logging

from ember_operator.kopf_setup import QuietSuccess


def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)


def test_handler_successes_are_dropped_everything_else_passes() -> None:
    quiet = QuietSuccess()
    assert not quiet.filter(_record(logging.INFO, "Handler 'pod_event' succeeded."))
    assert not quiet.filter(_record(logging.INFO, "Handler 'infd_event' succeeded."))
    assert quiet.filter(_record(logging.INFO, "applied Deployment ns/a"))
    assert quiet.filter(_record(logging.INFO, "thermal: tainted node-a"))
    assert quiet.filter(_record(logging.ERROR, "Handler 'infd_event' failed with an exception."))


def test_the_filter_is_installed_on_kopfs_object_logger() -> None:
    filters = logging.getLogger("kopf.objects").filters
    assert any(isinstance(f, QuietSuccess) for f in filters)
