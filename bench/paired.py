"""Repeats and paired ratios: the one way every bench here states a comparison.

A machine that drifts by more than a goal's margin within minutes (this one did: raw decode
58.5-70.7 tok/s in one half hour) makes a ratio of two medians taken minutes apart a measure of
the drift. So the runs are interleaved (every server once per repeat, in turns), a ratio is
taken within one repeat, and a goal is judged on the median of those paired ratios; the range
(min-max over repeats) is printed beside it, so a verdict that flips from repeat to repeat shows.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratios(ours: Mapping[int, float], peer: Mapping[int, float]) -> list[float]:
    """ours[r] / peer[r] for every repeat r both have (a zero peer value is skipped)."""
    return [ours[r] / peer[r] for r in sorted(ours) if peer.get(r)]


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)', or the one value when there is one."""
    if not values:
        return "-"
    mid = fmt.format(median(values))
    if len(values) == 1:
        return mid
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"
