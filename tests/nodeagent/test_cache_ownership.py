"""The node cache's directories belong to the agent's uid (issue 34: after `make test`, `failed/`
was root's while `sha256/` was the agent's, so the agent could not record a failure and prewarm
never saw ModelDownloadFailed).

The chart's own init container command (rendered by helm) runs as root here, as it does on a
node, over a cache that root wrote into; then a process with the agent's uid (the chart's
`podSecurityContext.runAsUser`) records a failure and writes a blob, as the agent does. No
cluster; real directories, real uids (the test runs as root to change them)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.contract import reasons
from ember_runtime.nodeagent.cache import ContentCache, FetchError
from ember_runtime.nodeagent.cachedirs import prepare

from tests.thermal.kube_support import chart_objects

ROOT = Path(__file__).resolve().parents[2]
SHA = "ab" * 32

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners: needs root")


@pytest.fixture
def cache_root() -> Iterator[Path]:
    """A cache root another uid can reach (pytest's tmp_path is root's alone)."""
    with tempfile.TemporaryDirectory(prefix="ember-cache-") as top:
        Path(top).chmod(0o755)
        yield Path(top) / "cache"


def _init_container() -> tuple[list[str], int]:
    """The chart's cache-dir init container as the node runs it: its argv, under root with only
    the capabilities the chart gives it (setpriv's bounding set), and the agent's uid."""
    (daemonset,) = [
        o for o in chart_objects("nodeagent-daemonset.yaml") if o["kind"] == "DaemonSet"
    ]
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "cache-dir"]
    caps = init["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in caps["add"])])
    return ["setpriv", f"--bounding-set={bounding}", "--", *init["command"]], int(
        pod["securityContext"]["runAsUser"]
    )


def _run_init(command: list[str], cache_root: Path) -> None:
    argv = [sys.executable if word == "python" else word for word in command]
    argv[argv.index("/cache")] = str(cache_root)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}/runtime"}
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _as_agent(uid: int, root: Path) -> str | None:
    """What the agent does with the cache, in a forked process with the agent's uid and gid
    (forked, not exec'd: the agent's uid cannot run this checkout's interpreter); the error it
    met, or None."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the agent's ids, write as the agent does, report
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            cache = ContentCache(root)
            cache.record_failure(SHA, FetchError("HTTP 404", reasons.MODEL_DOWNLOAD_FAILED))
            cache.path(SHA).write_bytes(b"x")
            cache.note_waiting(SHA, "outside the download window")
        except BaseException as err:  # reported to the parent, whatever it is
            os.write(write, repr(err).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        error = pipe.read()
    os.waitpid(pid, 0)
    return error or None


def test_the_init_container_gives_a_root_written_cache_to_the_agent(cache_root: Path) -> None:
    command, uid = _init_container()
    cache = ContentCache(cache_root)
    for path in (cache.root, cache.blobs, cache.failures):  # as `make test` left them
        path.mkdir(mode=0o755)
    os.chown(cache.blobs, uid, uid)  # sha256/ is the agent's, failed/ and the root are root's
    assert cache.failures.stat().st_uid == 0
    _run_init(command, cache_root)
    assert _as_agent(uid, cache_root) is None
    assert cache.failure(SHA) == "ModelDownloadFailed: HTTP 404"
    for path in (cache.root, *cache.directories()):
        info = path.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (uid, uid, 0o755), path


def test_the_init_container_adds_a_missing_directory_to_the_agents_cache(cache_root: Path) -> None:
    """Every start after the first: the root is already the agent's, and root without
    CAP_DAC_OVERRIDE cannot create in it (`Permission denied: '/cache/waiting'`, the init
    container crash-looping on the real node)."""
    command, uid = _init_container()
    cache = ContentCache(cache_root)
    for path in (cache.root, cache.blobs):
        path.mkdir(mode=0o755)
        os.chown(path, uid, uid)
    _run_init(command, cache_root)
    assert _as_agent(uid, cache_root) is None
    for path in (cache.root, *cache.directories()):
        info = path.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (uid, uid, 0o755), path


def test_a_symlink_in_the_cache_is_refused_not_followed(cache_root: Path, tmp_path: Path) -> None:
    """A chown through a symlink would hand some other host directory to the agent."""
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    cache_root.mkdir()
    (cache_root / "failed").symlink_to(elsewhere)
    with pytest.raises(NotADirectoryError):
        prepare(cache_root, 4242)
    assert elsewhere.stat().st_uid == 0
