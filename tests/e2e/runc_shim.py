#!/usr/bin/python3
"""An OCI runtime for dockerd on hosts whose capability bounding set withholds a capability.

Docker asks for every capability it knows for a `--privileged` container (kind's nodes are
privileged); runc then fails with "unable to apply caps: operation not permitted" when the
host's bounding set lacks one (this VM withholds CAP_SYS_RESOURCE). This wrapper removes the
capabilities the host does not have from the bundle's config.json (`create`/`run`) or the
process spec (`exec --process`), then execs the real runc with the same arguments.

Installed by tests/e2e/docker_host.py, only on such hosts; standard library only, because
dockerd runs it with the system python3 and no virtualenv.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

RUNC = os.environ.get("EMBER_REAL_RUNC", "/usr/sbin/runc")
CAP_SETS = ("bounding", "effective", "inheritable", "permitted", "ambient")
# Bit numbers from linux/capability.h, for the capabilities a bounding set may withhold.
CAP_NAMES = {24: "CAP_SYS_RESOURCE", 38: "CAP_PERFMON", 39: "CAP_BPF", 40: "CAP_CHECKPOINT_RESTORE"}


def bounding_set(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise ValueError("no CapBnd line in /proc/self/status")


def withheld(bounding: int) -> set[str]:
    """The known capabilities the bounding set lacks."""
    return {name for bit, name in CAP_NAMES.items() if not bounding >> bit & 1}


def strip_caps(process: dict[str, Any], drop: set[str]) -> bool:
    """Remove `drop` from a process spec's capability sets; whether anything changed."""
    caps = process.get("capabilities") or {}
    changed = False
    for key in CAP_SETS:
        kept = [c for c in caps.get(key) or [] if c not in drop]
        if len(kept) != len(caps.get(key) or []):
            caps[key] = kept
            changed = True
    return changed


def spec_file(argv: list[str]) -> tuple[Path, bool] | None:
    """The JSON file runc will read: (path, is_bundle_config) or None."""
    for i, arg in enumerate(argv):
        for flag, is_bundle in (
            ("--bundle", True),
            ("-b", True),
            ("--process", False),
            ("-p", False),
        ):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            return (Path(value) / "config.json", True) if is_bundle else (Path(value), False)
    return None


def rewrite(argv: list[str], drop: set[str]) -> None:
    found = spec_file(argv)
    if found is None or not drop or not found[0].is_file():
        return
    path, is_bundle = found
    spec = json.loads(path.read_text())
    process = spec.get("process", {}) if is_bundle else spec
    if strip_caps(process, drop):
        tmp = path.with_name(path.name + ".ember-tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(path)


def main() -> None:
    drop = withheld(bounding_set(Path("/proc/self/status").read_text()))
    rewrite(sys.argv[1:], drop)
    os.execv(RUNC, [RUNC, *sys.argv[1:]])


if __name__ == "__main__":
    main()
