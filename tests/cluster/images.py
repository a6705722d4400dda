"""Container images without a registry: a pause image and a Debian base image with Python.

No registry is reachable here, so images are assembled locally and imported into containerd:
- `pause`: the kubelet's sandbox image, a ~20-line static C program (the upstream pause.c idea:
  sleep until SIGINT/SIGTERM, reap zombies).
- `base`: a Debian rootfs made by `debootstrap` (minbase + python3), the base for Ember's own
  images (see images/ and the e2e issue). For another architecture (`arm64`, the images of
  `make arm64-proof`) `debootstrap --arch` runs its second stage under qemu-user-static/binfmt.
Both are written as docker-archive tarballs (manifest.json + config + one layer), which
`ctr images import` names from their RepoTags. Results are cached by content in the cache dir.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from images.build import HOST_ARCH
from tests.cluster.build import log
from tests.cluster.paths import cache_root
from tests.support.model import sha256_file

PAUSE_IMAGE = "ember.local/pause:3.10"
BASE_IMAGE = "ember.local/base:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("EMBER_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "procps", "iproute2")


def base_image(arch: str = HOST_ARCH) -> str:
    """The base's name: the host's keeps its plain tag, another architecture's is suffixed."""
    return BASE_IMAGE if arch == HOST_ARCH else f"{BASE_IMAGE}-{arch}"


PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = stop; sigaction(SIGINT, &sa, NULL); sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = reap; sa.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &sa, NULL);
    for (;;) pause();
    return 0;
}
"""


def images_dir() -> Path:
    path = cache_root() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_docker_archive(
    layer_tar: Path, out: Path, ref: str, config: dict[str, object], arch: str = HOST_ARCH
) -> Path:
    """Wrap one uncompressed layer tar into a docker-archive that `ctr images import` names."""
    diff_id = "sha256:" + sha256_file(layer_tar)
    image_config = {
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "ember tests.cluster.images"}],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": ["layer.tar"]}]
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:
        for name, data in (
            (config_name, config_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.add(layer_tar, arcname="layer.tar")
    tmp.rename(out)
    return out


def build_pause() -> Path:
    out = images_dir() / "pause.tar"
    if out.exists():
        return out
    log("building the pause image")
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp, "pause.c"), Path(tmp, "pause")
        src.write_text(PAUSE_C)
        subprocess.run(["gcc", "-static", "-Os", "-s", "-o", str(binary), str(src)], check=True)
        layer = Path(tmp, "layer.tar")
        with tarfile.open(layer, "w") as tar:
            tar.add(binary, arcname="pause")
        write_docker_archive(layer, out, PAUSE_IMAGE, {"Entrypoint": ["/pause"], "User": "65535"})
    return out


def debootstrap(
    rootfs: Path, arch: str = HOST_ARCH, packages: tuple[str, ...] = BASE_PACKAGES
) -> None:
    """A minbase Debian for `arch` with `packages` into `rootfs` (the kind node's too)."""
    log(f"debootstrap {DEBIAN_SUITE} {arch} ({', '.join(packages)}) — a few minutes, once")
    cmd = [
        "debootstrap",
        f"--arch={arch}",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        DEBIAN_SUITE,
        str(rootfs),
        DEBIAN_MIRROR,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    # Slim the layer: apt lists, caches and docs are not needed at run time.
    for sub in ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(rootfs / sub, ignore_errors=True)


def tar_rootfs(rootfs: Path, layer: Path) -> None:
    # tar(1) keeps devices, hardlinks, xattrs and ownership exactly as debootstrap left them.
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(layer), "."],
        check=True,
    )


def base_tar(arch: str = HOST_ARCH) -> Path:
    """The base image's cache file, keyed by what goes into it (the host's key predates arch)."""
    what = f"{DEBIAN_SUITE} {BASE_PACKAGES}" + ("" if arch == HOST_ARCH else f" {arch}")
    key = hashlib.sha256(what.encode()).hexdigest()[:12]
    return images_dir() / f"base-{key}.tar"


def build_base(arch: str = HOST_ARCH) -> Path:
    out = base_tar(arch)
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap is required (apt-get install debootstrap)")
    work = images_dir() / f"base-build-{arch}"
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True)
    debootstrap(rootfs, arch)
    layer = work / "layer.tar"
    tar_rootfs(rootfs, layer)
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]
    config: dict[str, object] = {"Env": env, "Cmd": ["/bin/sh"]}
    write_docker_archive(layer, out, base_image(arch), config, arch)
    shutil.rmtree(work, ignore_errors=True)
    return out


def ensure_images() -> list[Path]:
    return [build_pause(), build_base()]


def buildah_images() -> set[str]:
    """name:tag of every image in buildah's store, with and without the `localhost/` it adds."""
    listed = subprocess.run(
        ["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    return set(listed) | {n.removeprefix("localhost/") for n in listed}


def ensure_base_in_buildah(arch: str = HOST_ARCH) -> str:
    """The local Debian base (debootstrap) for `arch`, loaded into buildah's store once; its
    name."""
    ref = base_image(arch)
    if ref not in buildah_images():
        pull = ["buildah", "pull", "-q", f"docker-archive:{build_base(arch)}"]
        subprocess.run(pull, check=True, capture_output=True)
    return ref


if __name__ == "__main__":
    for p in ensure_images():
        print(p)
