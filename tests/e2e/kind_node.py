"""kind and a kind node image, built here with no registry: `python -m tests.e2e.kind_node`.

- kind itself from the Go module proxy (its module also carries images/base/: the node's
  entrypoint, systemd units and containerd config).
- The node image: a Debian rootfs (debootstrap) with systemd, containerd, runc and the CNI
  plugins from Debian's packages, kind's base files, and the Kubernetes binaries the local
  cluster builds (tests/cluster/build.py, plus kubeadm and kube-proxy); imported with
  `docker import`.
- kubeadm runs the control plane from images, so every image `kubeadm config images list`
  names is made here from the same binaries (single-layer docker-archives) and preloaded into
  the node's containerd, as `kind build node-image` does: kube-apiserver, -controller-manager,
  -scheduler and etcd (static binaries), kube-proxy (on the node's own rootfs: it runs
  iptables), CoreDNS (built from the module proxy) and pause (tests/cluster/images.py).
- kindnetd is replaced by tests/e2e/kindnet.py on the local Debian base (same CNI layout:
  ptp + host-local per node podCIDR, routes to the other nodes); local-path-provisioner by
  kind's own fallback (a host-path StorageClass: no image).

Everything is cached under ~/.cache/ember/kind and in dockerd's image store, keyed by what
goes into it; a second call builds nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO

from tests.cluster.build import (
    ETCD_VERSION,
    KIND_BINARIES,
    KUBE_BINARIES,
    KUBERNETES_VERSION,
    Tool,
    build_tool,
    ensure_binaries,
    log,
)
from tests.cluster.images import (
    DEBIAN_SUITE,
    build_base,
    build_pause,
    debootstrap,
    tar_rootfs,
    write_docker_archive,
)
from tests.e2e.docker_host import kind_dir

KIND = Tool("kind-v0.33.0", "sigs.k8s.io/kind", "v0.33.0", "sigs.k8s.io/kind")
CRICTL = Tool(
    "crictl-v1.36.0", "sigs.k8s.io/cri-tools", "v1.36.0", "sigs.k8s.io/cri-tools/cmd/crictl"
)
COREDNS = Tool(
    "coredns-v1.14.2", "github.com/coredns/coredns", "v1.14.2", "github.com/coredns/coredns"
)
NODE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "conntrack", "iptables", "nftables", "iproute2",
    "ethtool", "util-linux", "mount", "kmod", "libseccomp2", "pigz", "bash", "ca-certificates",
    "procps", "jq", "curl", "containerd", "runc", "containernetworking-plugins",
)  # fmt: skip
KINDNET_IMAGE = "ember.local/kindnet:dev"
# The names `kubeadm config images list --kubernetes-version v1.36.3` gives.
REGISTRY = "registry.k8s.io"
ETCD_TAG = f"{ETCD_VERSION.removeprefix('v')}-0"
COREDNS_TAG = "v1.14.2"
PAUSE_TAG = "3.10.2"
NODE_IMAGE_REPO = "ember.local/kind-node"


def ensure_tools() -> Path:
    """kind, crictl, CoreDNS and the Kubernetes binaries (kubeadm, kube-proxy too)."""
    out = ensure_binaries(KIND_BINARIES)
    for tool in (KIND, CRICTL, COREDNS):
        build_tool(tool, out)
    return out


def kind_binary() -> Path:
    return ensure_tools() / KIND.name


def kind_base_files() -> Path:
    """images/base/files of the kind module (in the Go module cache once kind was built)."""
    gopath = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True)
    files = Path(gopath.stdout.strip()) / f"{KIND.module}@{KIND.version}" / "images/base/files"
    if not files.is_dir():
        raise SystemExit(f"kind's base files are missing at {files}")
    return files


def _copy_kind_files(rootfs: Path, files: Path) -> None:
    """What kind's images/base Dockerfile COPYs (--chmod 0644, scripts 0755), with Debian's
    binary paths. Not copytree: the Go module cache is read-only and its modes would follow."""
    for src in sorted(files.rglob("*")):
        if src.is_dir():
            continue
        dest = rootfs / src.relative_to(files)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        script = dest.parent in (rootfs / "kind/bin", rootfs / "usr/local/bin")
        dest.chmod(0o755 if script else 0o644)
    for sub in ("kind", "kind/bin"):
        (rootfs / sub).chmod(0o755)
    # The unit runs /usr/local/bin/containerd; Debian installs /usr/bin/containerd.
    (rootfs / "usr/local/bin/containerd").symlink_to("/usr/bin/containerd")
    (rootfs / "opt/cni").mkdir(parents=True, exist_ok=True)
    (rootfs / "opt/cni/bin").symlink_to("/usr/lib/cni")
    (rootfs / "etc/kubernetes/manifests").mkdir(parents=True, exist_ok=True)


def _containerd_config(rootfs: Path) -> None:
    """kind's config, for Debian's containerd 1.6 on a host without CAP_SYS_RESOURCE."""
    path = rootfs / "etc/containerd/config.toml"
    text = path.read_text()
    # The fuse-overlayfs proxy plugin is for rootless nodes; Debian has no snapshotter for it.
    head, _, rest = text.partition("[proxy_plugins]")
    rest = rest[rest.index("[plugins.") :]
    text = head + rest
    text = text.replace("registry.k8s.io/pause:3.10", f"{REGISTRY}/pause:{PAUSE_TAG}")
    # A negative oom_score_adj needs CAP_SYS_RESOURCE (the local node has the same setting).
    text = text.replace("restrict_oom_score_adj = false", "restrict_oom_score_adj = true")
    path.write_text(text)
    spec = subprocess.run(
        ["chroot", str(rootfs), "ctr", "oci", "spec"], capture_output=True, text=True, check=True
    )
    base = json.loads(spec.stdout)
    hooks = base.setdefault("hooks", {}).setdefault("createContainer", [])
    hooks.append({"path": "/kind/bin/mount-product-files.sh"})
    base["process"].pop("rlimits", None)
    (rootfs / "etc/containerd/cri-base.json").write_text(json.dumps(base, indent=2))


def _systemd_setup(rootfs: Path) -> None:
    """The service set-up of kind's base Dockerfile."""
    for pattern in (
        "lib/systemd/system/multi-user.target.wants/*",
        "etc/systemd/system/*.wants/*",
        "lib/systemd/system/local-fs.target.wants/*",
        "lib/systemd/system/sockets.target.wants/*udev*",
        "lib/systemd/system/sockets.target.wants/*initctl*",
        "lib/systemd/system/basic.target.wants/*",
        "lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service",
    ):
        for path in rootfs.glob(pattern):
            path.unlink()
    with (rootfs / "etc/systemd/journald.conf").open("a") as conf:
        conf.write("ReadKMsg=no\n")
    systemctl = ["systemctl", f"--root={rootfs}"]
    for unit in ("kubelet.service", "containerd.service", "undo-mount-hacks.service"):
        subprocess.run([*systemctl, "enable", unit], check=True, capture_output=True)
    subprocess.run([*systemctl, "mask", "systemd-binfmt.service"], check=True, capture_output=True)


def _install_binaries(rootfs: Path, bins: Path) -> None:
    for name in ("kubeadm", "kubelet", "kubectl"):
        shutil.copy2(bins / name, rootfs / "usr/bin" / name)
    shutil.copy2(bins / CRICTL.name, rootfs / "usr/local/bin/crictl")
    (rootfs / "kind/version").write_text(KUBERNETES_VERSION)
    manifests = rootfs / "kind/manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    src = Path(__file__).with_name("kindnet.yaml").read_text()
    (manifests / "default-cni.yaml").write_text(src.replace("KINDNET_IMAGE", KINDNET_IMAGE))


def _content_key(bins: Path) -> str:
    """Changes with anything that goes into the node image."""
    digest = hashlib.sha256(f"{DEBIAN_SUITE} {NODE_PACKAGES} {KIND.version}".encode())
    for name in (Path(__file__).name, "kindnet.yaml", "kindnet.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    for name in (*KUBE_BINARIES, *KIND_BINARIES, f"etcd-{ETCD_VERSION}", COREDNS.name, CRICTL.name):
        digest.update(f"{name} {(bins / name).stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def _binary_image(binary: Path, ref: str, entry: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=kind_dir()) as tmp:
        layer = Path(tmp, "layer.tar")
        with tarfile.open(layer, "w") as tar:
            tar.add(binary, arcname=f"usr/local/bin/{entry}")
        config: dict[str, object] = {
            "Entrypoint": [f"/usr/local/bin/{entry}"],
            "Env": ["PATH=/usr/local/bin:/bin"],
        }
        return write_docker_archive(layer, out, ref, config)


def control_plane_images(bins: Path, work: Path) -> list[Path]:
    """Docker-archives under the names kubeadm asks for, plus the CNI's image."""
    v = KUBERNETES_VERSION
    out = []
    for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        out.append(_binary_image(bins / name, f"{REGISTRY}/{name}:{v}", name, work / f"{name}.tar"))
    etcd = f"{REGISTRY}/etcd:{ETCD_TAG}"
    out.append(_binary_image(bins / f"etcd-{ETCD_VERSION}", etcd, "etcd", work / "etcd.tar"))
    coredns = f"{REGISTRY}/coredns/coredns:{COREDNS_TAG}"
    out.append(_binary_image(bins / COREDNS.name, coredns, "coredns", work / "coredns.tar"))
    # kube-proxy runs iptables-restore and conntrack: the node's Debian plus the binary.
    proxy_layer = work / "kube-proxy-layer.tar"
    shutil.copy(debian_tar(), proxy_layer)
    with tarfile.open(proxy_layer, "a") as tar:
        tar.add(bins / "kube-proxy", arcname="usr/local/bin/kube-proxy")
    proxy: dict[str, object] = {
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    }
    out.append(
        write_docker_archive(
            proxy_layer, work / "kube-proxy.tar", f"{REGISTRY}/kube-proxy:{v}", proxy
        )
    )
    proxy_layer.unlink()
    out.append(_retag(build_pause(), f"{REGISTRY}/pause:{PAUSE_TAG}", work / "pause.tar"))
    out.append(_retag(build_base(), KINDNET_IMAGE, work / "kindnet.tar"))
    return out


def _retag(archive: Path, ref: str, out: Path) -> Path:
    """The same docker-archive under another name (only manifest.json's RepoTags change)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member) if member.isfile() else None
            if member.name == "manifest.json" and data is not None:
                manifest = json.loads(data.read())
                manifest[0]["RepoTags"] = [ref]
                raw = json.dumps(manifest).encode()
                member.size = len(raw)
                dst.addfile(member, io.BytesIO(raw))
            else:
                dst.addfile(member, data)
    return out


def _docker(*argv: str, stdin: IO[bytes] | None = None, stdout: int | None = None) -> None:
    subprocess.run(["docker", *argv], check=True, stdin=stdin, stdout=stdout)


def image_present(ref: str) -> bool:
    probe = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, check=False)
    return probe.returncode == 0


def debian_tar() -> Path:
    """The debootstrapped Debian of the node (cached on its own: it is the slow part)."""
    key = hashlib.sha256(str(NODE_PACKAGES).encode()).hexdigest()[:12]
    debian = kind_dir() / f"node-debian-{key}.tar"
    if not debian.exists():
        with tempfile.TemporaryDirectory(dir=kind_dir()) as tmp:
            fresh = Path(tmp) / "debian"
            debootstrap(fresh, packages=NODE_PACKAGES)
            tar_rootfs(fresh, debian.with_suffix(".partial"))
        debian.with_suffix(".partial").rename(debian)
    return debian


def _assemble_rootfs(work: Path, bins: Path) -> Path:
    """The node's filesystem as one tar."""
    debian = debian_tar()
    rootfs = work / "rootfs"
    rootfs.mkdir()
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-xf", str(debian)], check=True
    )
    _copy_kind_files(rootfs, kind_base_files())
    _containerd_config(rootfs)
    _systemd_setup(rootfs)
    _install_binaries(rootfs, bins)
    (rootfs / "usr/local/bin/kindnet").write_bytes(
        Path(__file__).with_name("kindnet.py").read_bytes()
    )
    (rootfs / "usr/local/bin/kindnet").chmod(0o755)
    out = work / "rootfs.tar"
    tar_rootfs(rootfs, out)
    shutil.rmtree(rootfs)
    return out


def _preload(base_ref: str, archives: list[Path], ref: str) -> None:
    """Import the images into the node's containerd, as `kind build node-image` does."""
    name = "ember-kind-node-build"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    _docker("run", "-d", "--name", name, "--privileged", "--entrypoint", "sleep", base_ref,
            "infinity", stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        _docker("exec", "-d", name, "sh", "-c", "containerd >/var/log/containerd-build.log 2>&1")
        _docker(
            "exec",
            name,
            "sh",
            "-c",
            "for i in $(seq 60); do ctr version >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1",
        )
        for archive in archives:
            with archive.open("rb") as stdin:
                _docker("exec", "-i", name, "ctr", "--namespace=k8s.io", "images", "import",
                        "--label=io.cri-containerd.pinned=pinned", "--all-platforms", "--no-unpack",
                        "--digests", "-", stdin=stdin, stdout=subprocess.DEVNULL)  # fmt: skip
        _docker(
            "exec",
            name,
            "sh",
            "-c",
            "pkill containerd; sleep 2; rm -f /var/log/containerd-build.log",
        )
        _docker("commit", name, f"{ref}-preloaded", stdout=subprocess.DEVNULL)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    # `docker commit --change` knows no STOPSIGNAL (systemd stops on SIGRTMIN+3): a metadata-
    # only build sets what kind's base Dockerfile sets.
    dockerfile = (
        f"FROM {ref}-preloaded\nENV container=docker\nSTOPSIGNAL SIGRTMIN+3\n"
        'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]\nCMD []\n'
    )
    subprocess.run(["docker", "build", "-q", "-t", ref, "-"], input=dockerfile.encode(),
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    _docker("rmi", f"{ref}-preloaded", stdout=subprocess.DEVNULL)


def _drop_other_node_images(keep: str) -> None:
    """Each node image is ~1.5 GB: the ones a new build replaced go (the disk is shared)."""
    listed = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", NODE_IMAGE_REPO],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    stale = [ref for ref in listed if ref != keep]
    if stale:
        subprocess.run(["docker", "rmi", *stale], capture_output=True, check=False)
    for old in kind_dir().glob("node-debian-*.tar"):
        if old != debian_tar():
            old.unlink()


def ensure_node_image() -> str:
    """The node image's name in dockerd's store; built when missing."""
    bins = ensure_tools()
    ref = f"{NODE_IMAGE_REPO}:{KUBERNETES_VERSION}-{_content_key(bins)}"
    if image_present(ref):
        return ref
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=kind_dir()) as tmp:
        work = Path(tmp)
        rootfs_tar = _assemble_rootfs(work, bins)
        log(f"node rootfs assembled in {time.monotonic() - start:.0f}s")
        base_ref = f"{ref}-base"
        _docker("import", str(rootfs_tar), base_ref, stdout=subprocess.DEVNULL)
        archives = control_plane_images(bins, work)
        rootfs_tar.unlink()
        _preload(base_ref, archives, ref)
        _docker("rmi", base_ref, stdout=subprocess.DEVNULL)
    _drop_other_node_images(ref)
    log(f"built the kind node image {ref} in {time.monotonic() - start:.0f}s")
    return ref


if __name__ == "__main__":
    from tests.e2e.docker_host import ensure_engine

    ensure_engine()
    print(ensure_node_image())
