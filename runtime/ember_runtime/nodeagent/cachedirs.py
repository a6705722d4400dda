"""`python -m ember_runtime.nodeagent.cachedirs ROOT UID`: hand the node cache to the agent.

The chart's init container runs this as root (CAP_CHOWN and CAP_FOWNER only) before the agent
starts. The kubelet creates a missing hostPath directory as root, and anything that ever wrote
into the cache as root (an older agent, a test, a person) leaves root-owned directories behind;
an agent that cannot write `failed/` cannot record a failure, and prewarm then waits instead of
reporting `ModelDownloadFailed`. So the root and each directory the agent writes into
(`ContentCache.directories`) are created if missing and given to the agent's uid, mode 0755
(prewarm, another uid, reads them). A symlink in their place is refused, never followed: a
chown through it would hand some other host directory to the agent.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from ember_runtime.nodeagent.cache import ContentCache


def prepare(root: Path, uid: int, gid: int | None = None) -> list[Path]:
    """Create and own the cache's directories; returns them. Raises OSError (a symlink or a
    non-directory in the way, or no permission).

    Without CAP_DAC_OVERRIDE root cannot create entries in a directory it does not own, and
    the root is the agent's from any earlier start: so it is this process's while the missing
    directories are made, and the agent's again after."""
    gid = uid if gid is None else gid
    cache = ContentCache(root)
    _directory(cache.root)
    os.chown(cache.root, os.geteuid(), os.getegid(), follow_symlinks=False)
    done = []
    try:
        for path in cache.directories():
            _directory(path)
            _own(path, uid, gid)
            done.append(path)
    finally:
        _own(cache.root, uid, gid)
    return [cache.root, *done]


def _directory(path: Path) -> None:
    with suppress(FileExistsError):
        path.mkdir(mode=0o755)
    if not stat.S_ISDIR(path.lstat().st_mode):
        raise NotADirectoryError(f"{path} is not a directory (a symlink is refused)")


def _own(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid, follow_symlinks=False)
    os.chmod(path, 0o755, follow_symlinks=False)  # noqa: S103 - prewarm (another uid) reads


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m ember_runtime.nodeagent.cachedirs ROOT UID", file=sys.stderr)
        return 2
    try:
        for path in prepare(Path(args[0]), int(args[1])):
            print(f"{path}: owner {args[1]}, mode 0755")
    except OSError as err:
        print(f"cannot prepare the node cache: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
