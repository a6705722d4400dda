"""Fake `pynvml` for the adapter's tests: the GPU count is whatever the test sets."""

from __future__ import annotations

device_count = 1  # a test sets 0 for a machine without a GPU, -1 for a missing driver


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    if device_count < 0:
        raise NVMLError("Driver Not Loaded")


def nvmlDeviceGetCount() -> int:
    return device_count


def nvmlShutdown() -> None:
    pass
