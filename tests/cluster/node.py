"""The real node: Debian's containerd + runc + CNI plugins, and a kubelet from source.

Facts of this VM that the configuration encodes (each one cost a failed start to learn):
- PID 1 is not systemd → cgroupfs driver everywhere (kubelet and containerd's runc options).
- cgroup v1 (hybrid) → kubelet ≥ 1.35 needs `failCgroupV1: false`.
- root lacks CAP_SYS_RESOURCE → containerd needs `restrict_oom_score_adj = true`, else every
  sandbox fails with runc "can't get final child's PID from pipe".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from tests.cluster.build import log
from tests.cluster.control_plane import HOST_IP, NODE_NAME, ControlPlane, remove_host_address
from tests.cluster.images import BASE_IMAGE, PAUSE_IMAGE, ensure_images
from tests.cluster.pki import CertSpec
from tests.cluster.procs import ProcessTable
from tests.support.net import free_port
from tests.support.waiting import wait_for

KUBELET_ROOT = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_ROOT / "device-plugins"
POD_RESOURCES_SOCKET = KUBELET_ROOT / "pod-resources" / "kubelet.sock"
CNI_BIN = Path("/usr/lib/cni")
POD_CIDR = "10.244.0.0/24"
BRIDGE = "ember0"
RUN_DIR = Path("/run/ember-cluster")


class Node:
    def __init__(self, cp: ControlPlane, procs: ProcessTable) -> None:
        self.cp = cp
        self.procs = procs
        self.state = cp.state / "node"
        # Images persist across down/up (importing the base image costs seconds).
        self.containerd_root = cp.state.parent / "ember-cluster-containerd"
        self.containerd_sock = RUN_DIR / "containerd" / "containerd.sock"

    # -- containerd --------------------------------------------------------------------
    def _containerd_config(self) -> Path:
        cri = {
            "sandbox_image": PAUSE_IMAGE,
            "restrict_oom_score_adj": True,
            "enable_selinux": False,
            "containerd": {
                "snapshotter": os.environ.get("EMBER_SNAPSHOTTER", "overlayfs"),
                "default_runtime_name": "runc",
                "runtimes": {
                    "runc": {
                        "runtime_type": "io.containerd.runc.v2",
                        "options": {"SystemdCgroup": False},
                    }
                },
            },
            "cni": {"bin_dir": str(CNI_BIN), "conf_dir": str(self.state / "net.d")},
        }
        config = {
            "version": 2,
            "root": str(self.containerd_root),
            "state": str(RUN_DIR / "containerd-state"),
            "grpc": {"address": str(self.containerd_sock)},
            "disabled_plugins": [
                "io.containerd.snapshotter.v1.aufs",
                "io.containerd.snapshotter.v1.btrfs",
                "io.containerd.snapshotter.v1.zfs",
                "io.containerd.snapshotter.v1.devmapper",
            ],
            "plugins": {"io.containerd.grpc.v1.cri": cri},
        }
        path = self.state / "containerd.toml"
        path.write_text(_to_toml(config))
        return path

    def _cni_config(self) -> None:
        net_d = self.state / "net.d"
        net_d.mkdir(parents=True, exist_ok=True)
        conf = {
            "cniVersion": "1.0.0",
            "name": "ember",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(RUN_DIR / "cni-ipam"),
                    },
                }
            ],
        }
        (net_d / "10-ember.conflist").write_text(json.dumps(conf, indent=2))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["ctr", "--address", str(self.containerd_sock), "-n", "k8s.io", *args]
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def start_containerd(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        self._cni_config()
        config = self._containerd_config()
        self.procs.start("containerd", ["containerd", "--config", str(config)])
        wait_for(
            "containerd socket",
            lambda: self.ctr("version").returncode == 0,
            timeout=30,
            on_fail=lambda: self.procs.tail("containerd"),
            interval=0.1,
            tolerate=(Exception,),
        )

    def import_images(self) -> None:
        present = self.ctr("images", "ls", "-q").stdout.split()
        for ref, tar in zip((PAUSE_IMAGE, BASE_IMAGE), ensure_images(), strict=True):
            if not any(p.endswith(ref) for p in present):
                log(f"importing {ref}")
                self.ctr("images", "import", "--no-unpack", str(tar))

    def import_image(self, tar: Path) -> None:
        """Import a docker-archive or OCI tarball (used by the e2e to load Ember's images)."""
        self.ctr("images", "import", str(tar))

    # -- kubelet -------------------------------------------------------------------------
    def _kubelet_config(self) -> Path:
        cp = self.cp
        serving_crt, serving_key = cp.pki.issue(
            CertSpec(
                name="kubelet-serving",
                common_name=NODE_NAME,
                server=True,
                client=False,
                dns_names=(NODE_NAME, "localhost"),
                ips=("127.0.0.1", HOST_IP),
            )
        )
        self.healthz_port = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": HOST_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "tlsCertFile": str(serving_crt),
            "tlsPrivateKeyFile": str(serving_key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(cp.pki.ca_cert_path)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "resolvConf": "/etc/resolv.conf",
            "clusterDomain": "cluster.local",
            # The disk is shared with the rest of the machine: never evict test pods for it.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "5s",
            "serializeImagePulls": False,
            "podPidsLimit": 4096,
            "shutdownGracePeriod": "0s",
        }
        path = self.state / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_kubelet(self) -> None:
        if self.procs.running("kubelet"):
            return
        kubeconfig = self.cp.kubeconfig("kubelet", f"system:node:{NODE_NAME}", "system:nodes")
        config = self._kubelet_config()
        self.procs.start(
            "kubelet",
            [
                str(self.cp.bins / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={HOST_IP}",
                f"--root-dir={KUBELET_ROOT}",
                "--node-labels=ember.dev/local-node=true",
                "--v=1",
            ],
        )

    def restart_kubelet(self) -> None:
        """Stop and start the kubelet (it recreates kubelet.sock; device plugins re-register)."""
        self.procs.stop("kubelet")
        self.start_kubelet()

    def node_ready(self) -> bool:
        code, body = self.cp.get(f"/api/v1/nodes/{NODE_NAME}")
        if code != 200:
            return False
        conds = json.loads(body).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def up(self) -> None:
        self.start_containerd()
        self.import_images()
        self.start_kubelet()
        wait_for(
            f"node {NODE_NAME} Ready",
            self.node_ready,
            timeout=120,
            on_fail=lambda: self.procs.tail("kubelet", 60),
            interval=0.1,
            tolerate=(Exception,),
        )
        log(f"node {NODE_NAME} Ready")

    # -- teardown ------------------------------------------------------------------------
    def down(self) -> None:
        self.procs.stop("kubelet")
        if self.procs.running("containerd"):
            self._kill_pod_tasks()
        self.procs.stop("containerd")
        _kill_matching("containerd-shim", str(self.containerd_sock))
        _unmount_under(KUBELET_ROOT, RUN_DIR)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        remove_host_address()
        shutil.rmtree(RUN_DIR, ignore_errors=True)

    def _kill_pod_tasks(self) -> None:
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(0.5)
        for task in tasks:
            self.ctr("tasks", "delete", "-f", task, check=False)
            self.ctr("containers", "delete", task, check=False)


def _kill_matching(binary: str, needle: str) -> None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if binary in cmdline and needle in cmdline:
                os.kill(int(proc.name), 9)


def _unmount_under(*roots: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    targets = [m for m in mounts if any(m == str(r) or m.startswith(str(r) + "/") for r in roots)]
    for target in sorted(targets, key=len, reverse=True):  # children before parents
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _to_toml(data: dict[str, object], prefix: str = "") -> str:
    """Just enough TOML for containerd's config (tables, strings, bools, ints, string lists)."""
    scalars, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            scalars.append(f"{key} = {json.dumps(value)}")
    out = "\n".join(scalars) + "\n"
    for key, value in tables:
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        out += f"\n[{name}]\n" + _to_toml(value, name)
    return out


def _toml_key(key: str) -> str:
    return f'"{key}"' if "." in key else key
