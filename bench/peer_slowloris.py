"""The peer port under 2,000 slow connections, at full size (issue 34, hole 6).

    .venv/bin/python -m bench.peer_slowloris [--size-mib 1024] [--connections 2000] [--rounds 5]
        [--workdir /var/tmp] [--out FILE.json]

Three processes on real loopback sockets (tests/nodeagent/slowloris.py): a PeerServer over a
cache holding one file of `--size-mib`, an attacker keeping `--connections` connections open
that send nothing or dribble one header byte a second (reconnecting whenever the server drops
one), and signed transfers of the whole file, `--rounds` unloaded and `--rounds` under attack
(after 6 s of it, past the server's 5 s header timeout). Prints (and with --out writes) the
transfer times, the ratio of the medians (goal <= 1.2), the server's RSS before, under attack
and at peak, its thread count under attack, and the connection counts on both sides.
`make test` runs the same at 128 MiB with a looser bound (tests/nodeagent/test_peer_trust.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ember_runtime.nodeagent.cache import ContentCache

from tests.nodeagent import slowloris


def _holder(root: Path, size: int) -> str:
    cache = ContentCache(root)
    cache.blobs.mkdir(parents=True)
    hasher = hashlib.sha256()
    part = root / "file"
    with part.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 16 << 20))
            hasher.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    sha = hasher.hexdigest()
    part.rename(cache.path(sha))
    return sha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="peer-slowloris-", dir=args.workdir))
    try:
        sha = _holder(work / "holder", args.size_mib << 20)
        figures = slowloris.measure(
            work / "holder", sha, args.size_mib << 20, args.connections, rounds=args.rounds
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = json.dumps(figures.report(), indent=2)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
