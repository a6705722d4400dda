"""Download windows: parsing, open/close arithmetic (midnight wrap), and the fetcher waiting
outside its window with a note that prewarm quotes. Real origin, real cache; no cluster."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import io
import os
import threading
from pathlib import Path

import pytest
from ember_runtime.contract import reasons
from ember_runtime.contract.config import ModelFile, RuntimeConfig
from ember_runtime.kube import Endpoint, KubeClient
from ember_runtime.nodeagent import fetcher as fetcher_mod
from ember_runtime.nodeagent.cache import ContentCache, Want
from ember_runtime.nodeagent.fetcher import Fetcher
from ember_runtime.nodeagent.views import DigestViews
from ember_runtime.nodeagent.windows import Windows, parse
from ember_runtime.prewarm.cachewait import wait_for_cache
from ember_runtime.prewarm.errors import PrewarmError

from tests.nodeagent.origin import serve


def at(hour: int, minute: int = 0) -> dt.datetime:
    return dt.datetime(2026, 1, 1, hour, minute, tzinfo=dt.UTC)


@pytest.mark.parametrize("bad", ["1-2", "24:00-01:00", "01:00-01:00", "1:00-2:00", "01:60-02:00"])
def test_bad_windows_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="window"):
        parse([bad])


def test_open_close_arithmetic_with_a_midnight_wrap() -> None:
    w = Windows(["22:00-06:00", "12:00-13:00"])
    assert w.is_open(at(23)) and w.is_open(at(5, 59)) and w.is_open(at(12, 30))
    assert not w.is_open(at(6)) and not w.is_open(at(21, 59))
    assert w.opens_in(at(23)) == 0
    assert w.opens_in(at(7)) == 5 * 3600  # the next is 12:00
    assert w.opens_in(at(14)) == 8 * 3600  # then 22:00
    assert w.closes_in(at(23)) == 7 * 3600
    assert w.closes_in(at(7)) is None
    assert Windows([]).is_open(at(3)) and Windows([]).closes_in(at(3)) is None
    assert Windows(["00:00-12:00", "12:00-18:00"]).closes_in(at(1)) == 17 * 3600  # adjacent


DATA = os.urandom(200_000)
SHA = hashlib.sha256(DATA).hexdigest()


def test_outside_the_window_the_fetch_waits_and_prewarm_says_until_when(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 21:59:59 with a 22:00-23:00 window: the note appears, prewarm quotes it, and the
    download runs once the window opens (one second later)."""
    start = dt.datetime(2026, 1, 1, 21, 59, 59, tzinfo=dt.UTC)
    real = dt.datetime.now(dt.UTC)
    monkeypatch.setattr(fetcher_mod, "_utcnow", lambda: start + (dt.datetime.now(dt.UTC) - real))
    cache = ContentCache(tmp_path)
    config = RuntimeConfig(
        model_name="m",
        model_dir=str(tmp_path / "views"),  # prewarm reads the agent's view of the digest
        model_layout="sha256",
        model_wait_seconds=0.3,
        files=[ModelFile(path="m.gguf", sha256=SHA, size_bytes=len(DATA))],
    )
    with serve({"m": DATA}) as (base, origin):

        async def go() -> None:
            reader = KubeClient(Endpoint("https://127.0.0.1:9", Path("/nonexistent"), None))
            f = Fetcher(cache, reader, "n", "ns", windows=Windows(["22:00-23:00"]))
            task = asyncio.create_task(f._from_origin(Want(f"{base}/m", SHA, len(DATA))))
            await asyncio.sleep(0.3)
            assert origin.bytes_sent == 0
            note = (tmp_path / "waiting" / SHA).read_text().strip()
            assert note == "outside the download window until 22:00 UTC"
            DigestViews(cache, lambda: [SHA]).sync()  # the agent's view loop, once
            with pytest.raises(PrewarmError) as info:
                await asyncio.to_thread(
                    wait_for_cache, config, io.StringIO(), threading.Event(), 0.05
                )
            assert info.value.reason == reasons.MODEL_DOWNLOADING
            assert str(info.value).endswith("; outside the download window until 22:00 UTC")
            await asyncio.wait_for(task, 10)
            await reader.aclose()

        asyncio.run(go())
        assert origin.bytes_sent == len(DATA)
    assert cache.path(SHA).read_bytes() == DATA
    assert not (tmp_path / "waiting" / SHA).exists()
