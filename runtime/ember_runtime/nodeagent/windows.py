"""Download windows: the times of day (UTC) when origin (WAN) transfers may run.

`origin_windows` is a list of `HH:MM-HH:MM` spans in UTC; a span may wrap midnight
(`22:00-06:00`). Empty: always open. Outside every span an origin transfer waits, and one
that is running when its window closes stops at its next chunk (its partial is kept and
resumed with a Range request when the next window opens). The agent writes what it waits for
to `<cache>/waiting/<digest>` ("outside the download window until 22:00 UTC"), which prewarm
quotes in its `ModelDownloading` message. Transfers between site peers are not limited.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

_SPAN = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")
DAY = 24 * 60


@dataclass(frozen=True)
class Span:
    start: int  # minutes after midnight UTC
    end: int

    def contains(self, minute: float) -> bool:
        if self.start <= self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end  # wraps midnight


def parse(spans: list[str]) -> list[Span]:
    out = []
    for text in spans:
        m = _SPAN.match(text.strip())
        if m is None:
            raise ValueError(f"download window {text!r} is not HH:MM-HH:MM (UTC)")
        start, end = int(m[1]) * 60 + int(m[2]), int(m[3]) * 60 + int(m[4])
        if start == end:
            raise ValueError(f"download window {text!r} is empty")
        out.append(Span(start, end))
    return out


def _minute(now: dt.datetime) -> float:
    return now.hour * 60 + now.minute + now.second / 60 + now.microsecond / 60e6


class Windows:
    def __init__(self, spans: list[str]) -> None:
        self.spans = parse(spans)

    def is_open(self, now: dt.datetime) -> bool:
        return not self.spans or any(s.contains(_minute(now)) for s in self.spans)

    def opens_in(self, now: dt.datetime) -> float:
        """Seconds until a window is open (0 when one is)."""
        if self.is_open(now):
            return 0.0
        minute = _minute(now)
        return min(((s.start - minute) % DAY) * 60 for s in self.spans)

    def closes_in(self, now: dt.datetime) -> float | None:
        """Seconds until the open window closes (None: always open, or closed now). Adjacent
        or overlapping spans count as one."""
        if not self.spans or not self.is_open(now):
            return None
        waited = 0.0
        minute = _minute(now)
        for _ in range(len(self.spans) + 1):
            ends = [(s.end - minute) % DAY or DAY for s in self.spans if s.contains(minute)]
            if not ends:
                break
            step = max(ends)
            waited += step
            minute = (minute + step) % DAY
        return waited * 60


def until(now: dt.datetime, seconds: float) -> str:
    return (now + dt.timedelta(seconds=seconds)).strftime("%H:%M UTC")
