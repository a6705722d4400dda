"""etcd + kube-apiserver + controller-manager + scheduler on loopback."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from tests.cluster.build import ETCD_VERSION, log
from tests.cluster.pki import PKI, CertSpec
from tests.cluster.procs import ProcessTable
from tests.support.net import free_port
from tests.support.waiting import wait_for

SERVICE_CIDR = "10.96.0.0/16"
NODE_NAME = "ember-node"
# The node's and the apiserver's address: the kubelet refuses a loopback *address* as node IP,
# so the cluster adds this one to the `lo` interface (no dummy-interface module in this kernel);
# pods reach the apiserver and the kubelet through it via their bridge gateway.
HOST_IFACE = "lo"
HOST_IP = "10.243.255.1"


@dataclass
class Endpoints:
    etcd_client: int
    etcd_peer: int
    apiserver: int

    @classmethod
    def load_or_allocate(cls, path: Path) -> Endpoints:
        if path.exists():
            return cls(**json.loads(path.read_text()))
        eps = cls(etcd_client=free_port(), etcd_peer=free_port(), apiserver=free_port())
        path.write_text(json.dumps(asdict(eps)))
        return eps

    @property
    def server_url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver}"


def write_kubeconfig(
    path: Path, server: str, ca: Path, *, cert: Path, key: Path, user: str
) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "ember", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [{"name": "ember", "context": {"cluster": "ember", "user": user}}],
        "current-context": "ember",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def ensure_host_address() -> None:
    """Add HOST_IP to the loopback interface (idempotent)."""
    show = subprocess.run(
        ["ip", "-br", "addr", "show", HOST_IFACE], capture_output=True, text=True, check=False
    )
    if f"{HOST_IP}/32" not in show.stdout:
        subprocess.run(["ip", "addr", "add", f"{HOST_IP}/32", "dev", HOST_IFACE], check=True)


def remove_host_address() -> None:
    subprocess.run(
        ["ip", "addr", "del", f"{HOST_IP}/32", "dev", HOST_IFACE], capture_output=True, check=False
    )


class ControlPlane:
    def __init__(self, state: Path, bins: Path, procs: ProcessTable) -> None:
        self.state = state
        self.bins = bins
        self.procs = procs
        self.pki = PKI(state / "pki")
        self.eps = Endpoints.load_or_allocate(state / "endpoints.json")
        # etcd lives on tmpfs: fsync is free there, and the data is throwaway by design.
        self.etcd_dir = Path("/dev/shm/ember-cluster-etcd")

    # -- credentials -------------------------------------------------------------------------
    def kubeconfig(self, name: str, cn: str, org: str | None = None) -> Path:
        crt, key = self.pki.issue(CertSpec(name=name, common_name=cn, organization=org))
        return write_kubeconfig(
            self.state / f"{name}.kubeconfig",
            self.eps.server_url,
            self.pki.ca_cert_path,
            cert=crt,
            key=key,
            user=name,
        )

    @property
    def admin_kubeconfig(self) -> Path:
        return self.kubeconfig("admin", "ember-admin", "system:masters")

    # -- processes -----------------------------------------------------------------------
    def start_etcd(self) -> None:
        if self.procs.running("etcd"):
            return
        shutil.rmtree(self.etcd_dir, ignore_errors=True)
        client, peer = (
            f"http://127.0.0.1:{self.eps.etcd_client}",
            f"http://127.0.0.1:{self.eps.etcd_peer}",
        )
        self.procs.start(
            "etcd",
            [
                str(self.bins / f"etcd-{ETCD_VERSION}"),
                "--name",
                "ember",
                "--data-dir",
                str(self.etcd_dir),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"ember={peer}",
                "--log-level",
                "warn",
            ],
        )

    def start_apiserver(self) -> None:
        if self.procs.running("kube-apiserver"):
            return
        pki = self.pki
        crt, key = pki.issue(
            CertSpec(
                name="apiserver",
                common_name="kube-apiserver",
                server=True,
                client=False,
                dns_names=(
                    "localhost",
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                ),
                ips=("127.0.0.1", HOST_IP, "10.96.0.1"),
            )
        )
        kcrt, kkey = pki.issue(
            CertSpec(
                name="apiserver-kubelet-client",
                common_name="kube-apiserver-kubelet-client",
                organization="system:masters",
            )
        )
        sa_key, sa_pub = pki.service_account_keys()
        audit_policy = self.state / "audit-policy.yaml"
        audit_policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    # Writes only, metadata only: enough to count API writes per object.
                    "rules": [
                        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete"]},
                        {"level": "None"},
                    ],
                }
            )
        )
        self.procs.start(
            "kube-apiserver",
            [
                str(self.bins / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.eps.etcd_client}",
                "--bind-address=0.0.0.0",
                f"--secure-port={self.eps.apiserver}",
                f"--advertise-address={HOST_IP}",
                f"--tls-cert-file={crt}",
                f"--tls-private-key-file={key}",
                f"--client-ca-file={pki.ca_cert_path}",
                f"--kubelet-client-certificate={kcrt}",
                f"--kubelet-client-key={kkey}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={self.procs.logs / 'audit.log'}",
                "--audit-log-maxsize=200",
                "--audit-log-maxbackup=1",  # a day of tests wrote 1.6 GB of rotated logs
                "--audit-log-mode=batch",
                "--audit-log-batch-max-wait=1s",
                # EMBER_APISERVER_PROFILING=1 serves /debug/pprof (bench investigations only).
                "--profiling="
                + ("true" if os.environ.get("EMBER_APISERVER_PROFILING") == "1" else "false"),
                "--v=1",
            ],
        )

    def start_controllers(self) -> None:
        pki = self.pki
        sa_key, _ = pki.service_account_keys()
        cm = self.kubeconfig("controller-manager", "system:kube-controller-manager")
        self.procs.start(
            "kube-controller-manager",
            [
                str(self.bins / "kube-controller-manager"),
                f"--kubeconfig={cm}",
                f"--authentication-kubeconfig={cm}",
                f"--authorization-kubeconfig={cm}",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={pki.ca_cert_path}",
                f"--cluster-signing-cert-file={pki.ca_cert_path}",
                f"--cluster-signing-key-file={pki.ca_key_path}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Large simulated fleets: don't throttle the controllers behind the scheduler.
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                "--concurrent-deployment-syncs=10",
                "--concurrent-replicaset-syncs=10",
                "--v=1",
            ],
        )
        sched = self.kubeconfig("scheduler", "system:kube-scheduler")
        sched_config = self.state / "scheduler.yaml"
        sched_config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(sched), "qps": 200, "burst": 400},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        self.procs.start(
            "kube-scheduler",
            [
                str(self.bins / "kube-scheduler"),
                f"--config={sched_config}",
                f"--authentication-kubeconfig={sched}",
                f"--authorization-kubeconfig={sched}",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "--v=1",
            ],
        )

    # -- health -------------------------------------------------------------------------
    def _admin_ssl(self) -> ssl.SSLContext:
        crt, key = self.pki.issue(
            CertSpec(name="admin", common_name="ember-admin", organization="system:masters")
        )
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert_path))
        ctx.load_cert_chain(str(crt), str(key))
        return ctx

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(self.eps.server_url + path)
        with urllib.request.urlopen(req, context=self._admin_ssl(), timeout=5) as resp:
            return int(resp.status), str(resp.read().decode())

    def ready(self) -> bool:
        try:
            return self.get("/readyz")[0] == 200
        except OSError:
            return False

    def up(self) -> None:
        ensure_host_address()
        self.start_etcd()
        self.start_apiserver()
        wait_for(
            "kube-apiserver /readyz",
            self.ready,
            timeout=90,
            on_fail=lambda: self.procs.tail("kube-apiserver") + self.procs.tail("etcd"),
            interval=0.1,
            tolerate=(Exception,),
        )
        self.start_controllers()
        log(f"control plane ready at {self.eps.server_url}")

    def down(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self.procs.stop(name)
        shutil.rmtree(self.etcd_dir, ignore_errors=True)
