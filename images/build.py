"""Build Ember's own images from images/*.Dockerfile with buildah; push them to a registry.

    python -m images.build build|push [--registry R] [--tag T] [--platform P] [--base-image B]

Two users, one build path (`bud_argv`):
- The local cluster (`make cluster-build`, the e2e tests): built on the Debian base image this
  package makes (no registry is reachable here), tagged `ember.local/<name>:dev`, exported as
  docker-archives and imported into the node's containerd (`tests.cluster.ember_images`).
- `make images` / `make push REGISTRY=...` for a real cluster: the same build, tagged
  `<registry>/<name>:<tag>` (the names the chart renders from `image.registry`/`image.tag`), for
  one `--platform` (e.g. linux/arm64 for Jetson/RK3588, emulated through qemu-user-static/binfmt
  on an x86 host), then `buildah push` to `docker://<ref>`. For another architecture than the
  host's, the runtime's llama.cpp is cross-compiled on the host (images/llama_build.py) and
  handed to the build as a wheel: nothing is compiled under emulation.

buildah is daemonless (no Docker engine needed); its layer cache keeps the slow llama.cpp
compile to the first build. Everything runs as argv lists, never through a shell. Only the
standard library is imported at module level, so `make images` needs no virtualenv.
"""

from __future__ import annotations

import argparse
import os
import platform as host_platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from images.llama_build import CROSS, TARGET_CMAKE_ARGS, ensure_cross_wheel

REPO = Path(__file__).resolve().parents[1]
REGISTRY = "ember.local"
TAG = "dev"
# Debian's (and OCI's) name for this machine's architecture; the local base is built for it.
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(
    host_platform.machine(), host_platform.machine()
)
# The folder of the build context the runtime image takes a cross-built llama-cpp-python from.
WHEELS = "images/wheels"


@dataclass(frozen=True)
class EmberImage:
    name: str
    dockerfile: str

    @property
    def ref(self) -> str:
        """The local cluster's name for it."""
        return self.ref_in(REGISTRY, TAG)

    def ref_in(self, registry: str, tag: str) -> str:
        return f"{registry.rstrip('/')}/{self.name}:{tag}"


IMAGES = (
    EmberImage("ember-operator", "images/operator.Dockerfile"),
    EmberImage("ember-runtime", "images/runtime.Dockerfile"),
    EmberImage("ember-deviceplugin", "images/deviceplugin.Dockerfile"),
    EmberImage("ember-gateway", "images/gateway.Dockerfile"),
)


def target_arch(platform: str | None) -> str:
    """`linux/arm64` → `arm64`; no platform: the host's."""
    if not platform:
        return HOST_ARCH
    return platform.split("/")[1] if "/" in platform else platform


def _local_base(dry_run: bool, arch: str) -> str:
    """The local cluster's Debian base for `arch` (no registry needed; debootstrap --arch for
    another architecture), made by its harness and loaded into buildah's store unless this is
    a dry run."""
    from tests.cluster.images import base_image, ensure_base_in_buildah  # noqa: PLC0415 - venv

    return base_image(arch) if dry_run else ensure_base_in_buildah(arch)


def cross_built(image: EmberImage, arch: str) -> bool:
    """Whether this image's llama.cpp is cross-compiled on the host rather than in the build."""
    return image.name == "ember-runtime" and arch != HOST_ARCH and arch in CROSS


def stage_cross_wheel(arch: str) -> Path:
    """Cross-compile llama-cpp-python for `arch` (cached) and put it alone in the build
    context's images/wheels/<arch>/, which the runtime build installs it from."""
    wheel = ensure_cross_wheel(arch)
    folder = REPO / WHEELS / arch
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    shutil.copy2(wheel, folder / wheel.name)
    return folder / wheel.name


def _ca_secret() -> list[str]:
    """This machine reaches PyPI through a TLS-intercepting proxy: hand pip its CA bundle."""
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ["--secret", f"id=pip-ca,src={bundle}"] if bundle and Path(bundle).is_file() else []


def bud_argv(image: EmberImage, ref: str, base: str | None, platform: str | None) -> list[str]:
    """`buildah bud` for one image. `base` None: the Dockerfile's own (public) base image."""
    argv = ["buildah", "bud", "--quiet", "--layers", "--network", "host"]
    arch = target_arch(platform)
    if platform:
        argv += ["--platform", platform]
    if cross_built(image, arch):
        # pip must take the staged wheel (stage_cross_wheel), never compile under emulation.
        for arg in (f"LLAMA_WHEELS={WHEELS}/{arch}", "LLAMA_PIP_ARGS=--only-binary=:all:"):
            argv += ["--build-arg", arg]
        argv += ["--build-arg", "BUILD_PACKAGES="]
    elif image.name == "ember-runtime" and arch in TARGET_CMAKE_ARGS:
        argv += ["--build-arg", f"LLAMA_CMAKE_ARGS={TARGET_CMAKE_ARGS[arch]}"]
    if base:
        argv += ["--build-arg", f"BASE_IMAGE={base}"]
    return [*argv, *_ca_secret(), "-f", image.dockerfile, "-t", ref, "."]


def _run(argv: list[str], dry_run: bool) -> None:
    print(shlex.join(argv), flush=True)
    if not dry_run:
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def need_buildah() -> None:
    if shutil.which("buildah") is None:
        raise SystemExit("buildah is required to build Ember's images (apt-get install buildah)")


def _selected(names: Sequence[str]) -> list[EmberImage]:
    known = {i.name.removeprefix("ember-"): i for i in IMAGES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown image(s) {unknown}; known: {sorted(known)}")
    return [known[n] for n in names] if names else list(IMAGES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m images.build")
    parser.add_argument("action", choices=["build", "push"])
    parser.add_argument("--registry", default=REGISTRY, help="e.g. registry.example:5000/ember")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--platform", default="", help="e.g. linux/arm64 (default: this host)")
    parser.add_argument(
        "--base-image",
        default="",
        help="FROM image (default: the Dockerfiles' public python:3.11-slim-bookworm); "
        "'local' builds and uses the Debian base the local cluster uses (no registry needed)",
    )
    parser.add_argument("--only", nargs="*", default=[], help="operator, runtime, deviceplugin")
    parser.add_argument("--tls-verify", default="true", choices=["true", "false"])
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    return parser


# The parts of an OCI reference we build: registry host[:port] and path, and a tag.
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9._-]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not _REGISTRY.match(args.registry) or not _TAG.match(args.tag):
        raise SystemExit(f"not a registry/path and tag: {args.registry!r} {args.tag!r}")
    images = _selected(args.only)
    if not args.dry_run:
        need_buildah()
    for image in images:
        ref = image.ref_in(args.registry, args.tag)
        if args.action == "push":
            # Credentials: `buildah login <registry>` beforehand (kept in buildah's auth file).
            push = ["buildah", "push", f"--tls-verify={args.tls_verify}", ref, f"docker://{ref}"]
            _run(push, args.dry_run)
            continue
        base = args.base_image or None
        arch = target_arch(args.platform)
        if base == "local":
            base = _local_base(args.dry_run, arch)
        if cross_built(image, arch) and not args.dry_run:
            stage_cross_wheel(arch)
        _run(bud_argv(image, ref, base, args.platform or None), args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
