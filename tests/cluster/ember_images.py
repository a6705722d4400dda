"""Build Ember's own images from images/*.Dockerfile with buildah; push them to a registry.

Two users, one build path:
- The local cluster (`make cluster-build`, the e2e tests): built on the Debian base image this
  package makes (no registry is reachable here), tagged `ember.local/<name>:dev`, exported as
  docker-archives and imported into the node's containerd.
- `make images` / `make push REGISTRY=...` for a real cluster: the same build, tagged
  `<registry>/<name>:<tag>` (the names the chart renders from `image.registry`/`image.tag`), for
  one `--platform` (e.g. linux/arm64 for Jetson/RK3588, emulated through qemu-user-static/binfmt
  on an x86 host), then `buildah push` to `docker://<ref>`.

buildah is daemonless (no Docker engine needed); its layer cache keeps the slow llama.cpp
compile to the first build. Everything runs as argv lists, never through a shell. Only the
standard library is imported at module level, so `make images` needs no virtualenv.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.build import log

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "ember.local"
TAG = "dev"
# llama.cpp without -march=native needs its instruction-set baseline per architecture (see
# images/runtime.Dockerfile); x86-64's default there is AVX2/FMA/F16C.
LLAMA_CMAKE_ARGS = {
    "arm64": "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16",
}


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


def _buildah(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True)


def _ensure_base_in_buildah() -> str:
    """The local Debian base (debootstrap), loaded into buildah's store once; its name."""
    from tests.cluster.images import BASE_IMAGE, build_base

    present = subprocess.run(
        ["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if BASE_IMAGE not in present and f"localhost/{BASE_IMAGE}" not in present:
        _buildah("pull", "-q", f"docker-archive:{build_base()}")
    return BASE_IMAGE


def _local_base_name() -> str:
    from tests.cluster.images import BASE_IMAGE

    return BASE_IMAGE


def _ca_secret() -> list[str]:
    """This machine reaches PyPI through a TLS-intercepting proxy: hand pip its CA bundle."""
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ["--secret", f"id=pip-ca,src={bundle}"] if bundle and Path(bundle).is_file() else []


def bud_argv(image: EmberImage, ref: str, base: str | None, platform: str | None) -> list[str]:
    """`buildah bud` for one image. `base` None: the Dockerfile's own (public) base image."""
    argv = ["buildah", "bud", "--quiet", "--layers", "--network", "host"]
    if platform:
        argv += ["--platform", platform]
        arch = platform.split("/")[1] if "/" in platform else platform
        if image.name == "ember-runtime" and arch in LLAMA_CMAKE_ARGS:
            argv += ["--build-arg", f"LLAMA_CMAKE_ARGS={LLAMA_CMAKE_ARGS[arch]}"]
    if base:
        argv += ["--build-arg", f"BASE_IMAGE={base}"]
    return [*argv, *_ca_secret(), "-f", image.dockerfile, "-t", ref, "."]


def _run(argv: list[str], dry_run: bool) -> None:
    print(shlex.join(argv), flush=True)
    if not dry_run:
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def _need_buildah() -> None:
    if shutil.which("buildah") is None:
        raise SystemExit("buildah is required to build Ember's images (apt-get install buildah)")


def _image_id(ref: str) -> str:
    """The image `ref` names in buildah's store, or "" when there is none."""
    found = subprocess.run(
        ["buildah", "images", "--quiet", "--no-trunc", ref],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout else ""


def _drop_replaced(previous: str, current: str) -> None:
    """Remove the image a rebuild untagged. Every test session rebuilds from a changed tree,
    and each replaced image kept its own layers: 138 of them once filled 58 GB of this disk.
    Layers the new image or the build cache still use stay (buildah removes only the rest)."""
    if previous and previous != current:
        subprocess.run(["buildah", "rmi", previous], capture_output=True, check=False)


def build_image(image: EmberImage) -> Path:
    """Build one image for the local cluster (cached layers); export it as a docker-archive."""
    from tests.cluster.images import images_dir

    _need_buildah()
    base = _ensure_base_in_buildah()
    start = time.monotonic()
    slow = " (its first build compiles llama.cpp: minutes)" if image.name == "ember-runtime" else ""
    log(f"building {image.ref} from {image.dockerfile}{slow}")
    previous = _image_id(image.ref)
    subprocess.run(
        bud_argv(image, image.ref, base, None), cwd=REPO, check=True, stdout=subprocess.DEVNULL
    )
    _drop_replaced(previous, _image_id(image.ref))
    out = images_dir() / f"{image.name}.tar"
    out.unlink(missing_ok=True)
    _buildah("push", "-q", image.ref, f"docker-archive:{out}:{image.ref}")
    log(f"built {image.ref} in {time.monotonic() - start:.0f}s")
    return out


def build_all() -> dict[str, Path]:
    return {image.ref: build_image(image) for image in IMAGES}


def _selected(names: Sequence[str]) -> list[EmberImage]:
    known = {i.name.removeprefix("ember-"): i for i in IMAGES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown image(s) {unknown}; known: {sorted(known)}")
    return [known[n] for n in names] if names else list(IMAGES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.ember_images")
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
        _need_buildah()
    for image in images:
        ref = image.ref_in(args.registry, args.tag)
        if args.action == "push":
            # Credentials: `buildah login <registry>` beforehand (kept in buildah's auth file).
            push = ["buildah", "push", f"--tls-verify={args.tls_verify}", ref, f"docker://{ref}"]
            _run(push, args.dry_run)
            continue
        base = args.base_image or None
        if base == "local":
            base = _local_base_name() if args.dry_run else _ensure_base_in_buildah()
        _run(bud_argv(image, ref, base, args.platform or None), args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
