"""Background processes of the local cluster: started detached, tracked by pid files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.support.net import free_port, port_open
from tests.support.waiting import poll, wait_for


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); read its state so a crashed child counts as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


class ProcessTable:
    """One pid file and one log file per named process under `root`."""

    def __init__(self, root: Path) -> None:
        self.pids = root / "pids"
        self.logs = root / "logs"
        self.pids.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def pid(self, name: str) -> int | None:
        path = self.pids / f"{name}.pid"
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def running(self, name: str) -> bool:
        return self.pid(name) is not None

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        existing = self.pid(name)
        if existing is not None:
            return existing
        with self.log_path(name).open("ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # outlive `python -m tests.cluster up`
            )
        (self.pids / f"{name}.pid").write_text(str(proc.pid))
        return proc.pid

    def stop(self, name: str, grace: float = 10.0) -> None:
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            poll(lambda: not pid_alive(pid), grace, 0.05)  # then SIGKILL
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        (self.pids / f"{name}.pid").unlink(missing_ok=True)

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@contextlib.contextmanager
def port_forward(
    kubectl: str, kubeconfig: Path, service: str, namespace: str, port: int
) -> Iterator[int]:
    """`kubectl port-forward svc/<service>` on a free local port, through the real kubelet;
    yields the local port once it accepts connections."""
    local = free_port()
    cmd = [kubectl, f"--kubeconfig={kubeconfig}", "port-forward", "-n", namespace]
    cmd += [f"svc/{service}", f"{local}:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for("kubectl port-forward", lambda: port_open(local), timeout=30, interval=0.1)
        yield local
    finally:
        proc.terminate()
        proc.wait(timeout=10)
