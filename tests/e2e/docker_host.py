"""A Docker engine for `make e2e-kind` on this kind of host: started if none answers.

    python -m tests.e2e.docker_host          # idempotent; prints the engine's version

On an ordinary Docker host (an engine answers `docker info`) this does nothing. Otherwise it
starts Debian's `dockerd` (apt-get install docker.io) itself, and, only where the capability
bounding set withholds a capability that Docker grants privileged containers (this VM lacks
CAP_SYS_RESOURCE), registers tests/e2e/runc_shim.py as dockerd's default OCI runtime so that
kind's privileged node containers can start.

dockerd sets the iptables FORWARD policy to DROP when it starts; the local cluster's pods
(tests/cluster, a CNI bridge on the same host) are forwarded through that chain, so the
policy is put back to what it was before dockerd started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.cluster.build import log
from tests.cluster.paths import cache_root
from tests.e2e import runc_shim
from tests.support.waiting import wait_for

DAEMON_JSON = Path("/etc/docker/daemon.json")
RUNTIME = "ember-runc"


def kind_dir() -> Path:
    path = cache_root() / "kind"
    path.mkdir(parents=True, exist_ok=True)
    return path


def withheld_caps() -> set[str]:
    return runc_shim.withheld(runc_shim.bounding_set(Path("/proc/self/status").read_text()))


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=30)
    return probe.returncode == 0


def install_shim() -> Path:
    """Copy the shim where dockerd can always find it (not inside a worktree)."""
    dest = kind_dir() / "runc-shim"
    source = Path(runc_shim.__file__).read_bytes()
    if not dest.exists() or dest.read_bytes() != source:
        tmp = dest.with_suffix(".tmp")
        tmp.write_bytes(source)
        tmp.chmod(0o755)
        tmp.replace(dest)
    return dest


def write_daemon_json(shim: Path | None) -> None:
    """Merge our settings into daemon.json, keeping whatever else an admin put there."""
    config = json.loads(DAEMON_JSON.read_text()) if DAEMON_JSON.exists() else {}
    if shim is not None:
        config.setdefault("runtimes", {})[RUNTIME] = {"path": str(shim)}
        config["default-runtime"] = RUNTIME
    DAEMON_JSON.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    if not DAEMON_JSON.exists() or DAEMON_JSON.read_text() != text:
        DAEMON_JSON.write_text(text)


def forward_policy() -> str:
    rules = subprocess.run(
        ["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=True
    )
    first = rules.stdout.splitlines()[:1]
    return first[0].split()[-1] if first and first[0].startswith("-P FORWARD") else "ACCEPT"


def start_dockerd() -> None:
    if shutil.which("dockerd") is None:
        raise SystemExit(
            "no Docker engine answers and dockerd is missing (apt-get install docker.io)"
        )
    policy = forward_policy()
    logpath = kind_dir() / "dockerd.log"
    logfile = logpath.open("ab")
    log("starting dockerd (log: ~/.cache/ember/kind/dockerd.log)")
    subprocess.Popen(
        ["dockerd"],
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )

    def log_tail() -> str:
        tail = logpath.read_text(errors="replace").splitlines()[-20:]
        return "\n".join([f"{logpath} ends:", *tail])

    wait_for("dockerd to answer", engine_answers, 60, 1, on_fail=log_tail)
    if forward_policy() != policy:
        subprocess.run(["iptables", "-P", "FORWARD", policy], check=True)
        log(f"iptables FORWARD policy put back to {policy} (dockerd had set DROP)")


def ensure_engine() -> None:
    """A Docker engine that can start privileged containers on this host."""
    drop = withheld_caps()
    shim = install_shim() if drop else None
    if engine_answers():
        if shim is not None and default_runtime() != RUNTIME:
            raise SystemExit(
                f"dockerd runs without {RUNTIME} but this host withholds {sorted(drop)}: "
                f"stop it and rerun (daemon.json gets the runtime shim)"
            )
        return
    write_daemon_json(shim)
    start_dockerd()


def default_runtime() -> str:
    out = subprocess.run(
        ["docker", "info", "--format", "{{.DefaultRuntime}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


if __name__ == "__main__":
    ensure_engine()
    os.execvp("docker", ["docker", "version", "--format", "{{.Server.Version}}"])
    sys.exit(1)
