"""The agent's per-digest views (nodeagent/views.py) on a real directory: what a replica's
mount of one digest shows as the cache changes, and that nothing else is in it."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ember_runtime.contract import reasons
from ember_runtime.nodeagent.cache import ContentCache, FetchError
from ember_runtime.nodeagent.views import DigestViews

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()


def test_a_view_follows_its_digest_and_shows_nothing_else(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    cache.blobs.mkdir(parents=True)
    cache.path(B).write_bytes(b"b")  # another tenant's model, complete
    wanted = {A}
    views = DigestViews(cache, lambda: wanted)
    views.sync()
    view = views.view(A)
    assert sorted(p.name for p in views.root.iterdir()) == [A]  # no view of B
    assert list(view.iterdir()) == []
    # The download starts and grows: the view's partial is the same file, growing with it.
    with cache.partial(A).open("wb") as f:
        f.write(b"x" * 10)
        f.flush()
        views.sync()
        f.write(b"x" * 10)
    assert (view / "data.partial").stat().st_size == 20
    # Verified and renamed into place: `data` appears, the partial goes.
    cache.partial(A).write_bytes(b"a")
    cache.partial(A).rename(cache.path(A))
    views.sync()
    assert (view / "data").read_bytes() == b"a"
    assert (view / "data").samefile(cache.path(A))  # a link, no copy
    assert sorted(p.name for p in view.iterdir()) == ["data"]
    # Nobody here wants A any more: its view is emptied, the cache keeps the file.
    inode = view.stat().st_ino
    wanted.clear()
    views.sync()
    assert not any(view.iterdir()) and cache.path(A).exists()
    # Wanted again (an agent restart empties every view until its watch has read the pods
    # again): the same directory fills again, so a pod that mounted it sees the file.
    wanted.add(A)
    views.sync()
    assert view.stat().st_ino == inode
    assert (view / "data").samefile(cache.path(A))


def test_a_failure_and_a_wait_are_mirrored_and_cleared(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    views = DigestViews(cache, lambda: [A, "../../etc", "Z" * 64])  # bad names never get a view
    cache.record_failure(A, FetchError("h/m expected a… got b…", reasons.CHECKSUM_MISMATCH))
    cache.note_waiting(A, "outside the download window until 22:00 UTC")
    views.sync()
    assert sorted(p.name for p in views.root.iterdir()) == [A]
    view = views.view(A)
    assert (view / "failed").read_text().startswith("ChecksumMismatch: h/m expected")
    assert (view / "waiting").read_text().strip() == "outside the download window until 22:00 UTC"
    cache.clear_failure(A)
    cache.clear_waiting(A)
    views.sync()
    assert list(view.iterdir()) == []
