"""The local cluster as one object: build, up, down, status, env."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.cluster.build import ensure_binaries, log
from tests.cluster.control_plane import NODE_NAME, ControlPlane
from tests.cluster.fleet import start_kwok
from tests.cluster.node import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET, Node
from tests.cluster.paths import bin_dir, kubeconfig_path, state_dir
from tests.cluster.procs import ProcessTable

COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "containerd",
    "kubelet",
)


class Cluster:
    def __init__(self, state: Path | None = None) -> None:
        self.state = state or state_dir()
        self.state.mkdir(parents=True, exist_ok=True)
        self.procs = ProcessTable(self.state)
        self._components()

    def _components(self) -> None:
        # ControlPlane owns the credentials and ports under the state dir; made afresh after
        # `down()` deletes them, so one Cluster object can go down and up again.
        self.cp = ControlPlane(self.state, bin_dir(), self.procs)
        self.node = Node(self.cp, self.procs)

    @property
    def kubeconfig(self) -> Path:
        return kubeconfig_path()

    def up(self, with_node: bool = True) -> float:
        """Start whatever is not running; returns seconds spent. Idempotent."""
        ensure_binaries()
        start = time.monotonic()
        self.cp.up()
        admin = self.cp.admin_kubeconfig
        if admin != self.kubeconfig:
            self.kubeconfig.write_bytes(admin.read_bytes())
            self.kubeconfig.chmod(0o600)
        start_kwok(self.cp, self.procs)
        if with_node:
            self.node.up()
        elapsed = time.monotonic() - start
        log(f"cluster up in {elapsed:.1f}s — export KUBECONFIG={self.kubeconfig}")
        return elapsed

    def down(self) -> None:
        self.node.down()
        self.procs.stop("kwok")
        self.cp.down()
        # Credentials and ports are per run: the next `up` makes fresh ones (milliseconds).
        for path in (
            self.state / "pki",
            self.state / "endpoints.json",
            *self.state.glob("*.kubeconfig"),
        ):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self._components()
        log("cluster down")

    def status(self) -> dict[str, bool]:
        status = {name: self.procs.running(name) for name in COMPONENTS}
        status["apiserver-ready"] = status["kube-apiserver"] and self.cp.ready()
        return status

    def is_up(self, with_node: bool = True) -> bool:
        status = self.status()
        needed = COMPONENTS if with_node else COMPONENTS[:5]
        return all(status[n] for n in needed) and status["apiserver-ready"]

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig), "PATH": f"{bin_dir()}:{os.environ['PATH']}"}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        cmd = [str(bin_dir() / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def diagnostics(self) -> str:
        """What a failing test prints: component log tails."""
        return "\n".join(f"--- {name} ---\n{self.procs.tail(name, 20)}" for name in COMPONENTS)


__all__ = ["DEVICE_PLUGIN_DIR", "NODE_NAME", "POD_RESOURCES_SOCKET", "Cluster"]
