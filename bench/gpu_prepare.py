"""Build, from a fresh checkout, the folder `bench/gpu_run.sh` reads on the GPU machine
(`GPU_DIR`): everything that machine cannot download, since it reaches no network.

    python bench/gpu_prepare.py [--out .gpu] [--art DIR] [--check]

* `llama.cpp.tar.xz`: llama-cpp-python's vendored llama.cpp (sdist `VERSION` of
  `images/llama_build.py`, top folder `llama.cpp/`), less what a build of `llama` and
  `llama-server` with CUDA never reads (`PRUNED`): vocab files, docs, tests, examples, the web
  UI's sources, the ggml backends other than CPU and CUDA;
* `llama_cpp_py.tgz`: the same sdist's Python package `llama_cpp/`, no binaries (gpu_run.sh
  links its `lib/` to the CUDA build);
* `whl/`: wheels for CPython 3.12 on manylinux x86-64 (the machine's python3) of what the
  runtime server and `bench/gpu_bench.py` import and that machine's image lacks or may hold at
  another version (`WHEELS`, pinned: a rerun carries the same files);
* `wt/`: this checkout's `runtime/` and `bench/`: the machine runs `wt/bench/gpu_run.sh`, which
  builds and benchmarks from there;
* `art/`, with `--art DIR`: a previous run's `art.tar.xz.part-*`, which skips the CUDA build.

The folder is rebuilt from scratch on each call; the sdist and the wheels are cached under the
ember cache root. `--check` configures the pruned llama.cpp here (CPU only, no build) and runs
the step that generates the server's embedded UI, to show nothing the build reads was pruned.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from images.llama_build import VERSION, _sdist, cache_root

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
# What one call to the GPU machine carries, the repo's own files included.
SIZE_LIMIT = 64 * MIB
STAMP = ".gpu_prepare"  # marks a folder this script made, so it may delete it

# Paths under llama.cpp/ left out: none of them is read by CMake with LLAMA_BUILD_TESTS=OFF,
# LLAMA_BUILD_EXAMPLES=OFF (examples/ and pocs/ are only added then), GGML_RPC off and
# LLAMA_USE_PREBUILT_UI=OFF. models/ at the top holds vocab GGUFs and test data; the model
# graphs CMake compiles are src/models/*.cpp, kept. The `.git` file (the submodule's link to
# ../../.git/modules/vendor/llama.cpp, not in the tarball) stays: git then fails in the tree
# rather than finding a repository above the build folder and stamping its commit on the build.
PRUNED = (
    "models",
    "docs",
    "tests",
    "examples",
    "pocs",
    "benches",
    "media",
    "gguf-py",
    "conversion",
    "requirements",
    "skills",
    "ci",
    ".github",
    ".devops",
    ".gemini",
    ".pi",
    "tools/server/tests",
    "tools/server/bench",
    "tools/mtmd/tests",
    "tools/mtmd/test-1.jpeg",
    "tools/mtmd/test-2.mp3",
    "tools/mtmd/test-3.mp4",
)
# Folders of which only these files are kept. The server links llama-ui, whose sources
# scripts/ui-assets.cmake generates at build time from tools/ui's two templates: with no
# prebuilt UI and no npm build (LLAMA_BUILD_UI is off), an empty asset table.
KEPT_ONLY = {
    "scripts": frozenset({"ui-assets.cmake"}),
    "tools/ui": frozenset({"CMakeLists.txt", "sources.cmake", "ui.cpp.in", "ui.h.in"}),
}
# ggml/src/ggml-*/ holds one backend each; ggml/src/CMakeLists.txt adds a backend's folder
# only when its GGML_<NAME> option is on (all off but CPU by default; gpu_build.sh adds CUDA).
KEPT_BACKENDS = frozenset({"ggml-cpu", "ggml-cuda"})
# Flags of bench/gpu_build.sh, CUDA off: what --check configures with.
CHECK_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)

# Wheels for the GPU machine's python3 (CPython 3.12, x86-64): the runtime server
# (`python -m ember_runtime.server`, its engine and NVML sensor), `ember_runtime.prewarm`,
# llama-cpp-python's package and bench/gpu_bench.py + gpu_models.py, with what they require,
# at the versions this repo's venv resolves from pyproject.toml's pins. gpu_run.sh puts them
# ahead of the image's packages on PYTHONPATH, so a wheel here wins over the image's copy.
# Left to the image (KINDS.md lists them there; every requirement on them is a loose lower
# bound): numpy (2.5.2 there), certifi, idna, click, requests, tqdm, matplotlib (plots only).
# Carried although the image has a copy of unknown version: anyio, annotated-doc, h11, httpx,
# jinja2, markupsafe, nvidia-ml-py, prometheus-client, pyyaml, typing-extensions (pinned here
# or needed at a recent version by pydantic, fastapi and sse-starlette).
WHEELS = (
    ("annotated-doc", "0.0.7"),  # fastapi
    ("annotated-types", "0.8.0"),  # pydantic
    ("anyio", "4.16.0"),  # starlette, httpx
    ("diskcache", "5.6.3"),  # llama_cpp (llama_cache, imported by `import llama_cpp`)
    ("fastapi", "0.163.2"),
    ("gguf", "0.19.0"),  # bench/gpu_models.py
    ("h11", "0.16.0"),  # uvicorn, httpcore
    ("httpcore", "1.0.9"),  # httpx
    ("httpx", "0.28.1"),
    ("jinja2", "3.1.6"),
    ("markupsafe", "3.0.4"),  # jinja2
    ("nvidia-ml-py", "13.615.71"),  # pynvml: the NVML sensor and gpu_bench's sampler
    ("opentelemetry-api", "1.45.2"),  # fastapi
    ("prometheus-client", "0.26.0"),
    ("pydantic", "2.14.4"),
    ("pydantic-core", "2.50.5"),  # pydantic
    ("pydantic-settings", "2.16.3"),
    ("python-dotenv", "1.2.4"),  # pydantic-settings
    ("pyyaml", "6.0.4"),
    ("sse-starlette", "3.7.1"),  # the `runtime` extra lists it
    ("starlette", "1.10.0"),  # fastapi
    ("typing-extensions", "4.16.0"),
    ("typing-inspection", "0.4.5"),  # pydantic
    ("uvicorn", "0.54.0"),
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def pruned(rel: PurePosixPath, is_dir: bool = False) -> bool:
    """Whether a path under llama.cpp/ is left out of the tarball."""
    path = rel.as_posix()
    if any(path == p or path.startswith(p + "/") for p in PRUNED):
        return True
    for folder, kept in KEPT_ONLY.items():
        if path.startswith(folder + "/") and path[len(folder) + 1 :] not in kept:
            return True
    parts = rel.parts
    backend = parts[:2] == ("ggml", "src") and len(parts) >= 3 and parts[2].startswith("ggml-")
    return backend and (is_dir or len(parts) > 3) and parts[2] not in KEPT_BACKENDS


def _package_file(rel: PurePosixPath) -> bool:
    """Whether a file of the sdist's llama_cpp/ goes into llama_cpp_py.tgz: sources only. No
    `lib/` either: gpu_run.sh makes `llama_cpp/lib` a link to the CUDA build."""
    binary = rel.suffix in {".so", ".dylib", ".dll", ".pyc"}
    return not (binary or rel.parts[0] == "lib" or "__pycache__" in rel.parts)


def _add(out: tarfile.TarFile, src: tarfile.TarFile, member: tarfile.TarInfo, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = member.size, member.mtime
    info.mode, info.type, info.linkname = member.mode, member.type, member.linkname
    out.addfile(info, src.extractfile(member) if member.isfile() else None)


def write_sources(sdist: Path, llama_tar: Path, package_tgz: Path) -> tuple[int, int]:
    """Both source archives in one pass over the sdist; the number of files in each."""
    top = PurePosixPath(f"llama_cpp_python-{VERSION}")
    vendored, package = top / "vendor" / "llama.cpp", top / "llama_cpp"
    counts = [0, 0]
    with (
        tarfile.open(sdist, "r|gz") as src,
        tarfile.open(llama_tar, "w:xz") as llama,
        gzip.GzipFile(package_tgz, "wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as pkg,
    ):
        for member in src:
            path = PurePosixPath(member.name)
            if path.is_relative_to(vendored) and path != vendored:
                rel = path.relative_to(vendored)
                if not pruned(rel, member.isdir()):
                    _add(llama, src, member, f"llama.cpp/{rel}")
                    counts[0] += 1
            elif path.is_relative_to(package) and path != package:
                rel = path.relative_to(package)
                if not member.isdir() and _package_file(rel):
                    _add(pkg, src, member, f"llama_cpp/{rel}")
                    counts[1] += 1
    if not counts[0] or not counts[1]:
        raise SystemExit(f"{sdist}: no {vendored} or {package} in it")
    return counts[0], counts[1]


def _cached_wheel(cache: Path, name: str, version: str) -> Path:
    """name==version's wheel, downloaded once into its own folder of the cache."""
    slot = cache / f"{name}-{version}"
    wheels = sorted(slot.glob("*.whl"))
    if len(wheels) != 1:
        shutil.rmtree(slot, ignore_errors=True)
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        argv += ["--python-version", "3.12", "--implementation", "cp"]
        for platform in PLATFORMS:
            argv += ["--platform", platform]
        subprocess.run([*argv, "-d", str(slot), f"{name}=={version}"], check=True)
        wheels = sorted(slot.glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"pip left {len(wheels)} wheels for {name}=={version} in {slot}")
    return wheels[0]


def fetch_wheels(dest: Path) -> None:
    cache = cache_root().parent / "gpu-wheels" / "cp312-manylinux_x86_64"
    dest.mkdir()
    for name, version in WHEELS:
        wheel = _cached_wheel(cache, name, version)
        shutil.copy2(wheel, dest / wheel.name)


def _ignore_for(root: Path) -> Callable[[str, list[str]], set[str]]:
    caches = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache")

    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = set(caches(folder, names))
        if Path(folder) == root / "bench":
            skipped.add("results")
        return skipped

    return ignore


def copy_tree(dest: Path) -> None:
    """runtime/, bench/ and the test-support package the benchmarks import, as they are in
    this checkout, without caches and bench results; and images/llama_build.py, which
    bench/runtime_bench.py imports (stdlib only)."""
    for name in ("runtime", "bench", "tests/support"):
        shutil.copytree(REPO / name, dest / name, ignore=_ignore_for(REPO), symlinks=True)
    shutil.copy2(REPO / "tests" / "__init__.py", dest / "tests" / "__init__.py")
    (dest / "images").mkdir()
    for name in ("__init__.py", "llama_build.py"):
        shutil.copy2(REPO / "images" / name, dest / "images" / name)


def art_parts(art: Path) -> list[Path]:
    parts = sorted(art.glob("art.tar.xz.part-*"))
    if not parts:
        raise SystemExit(f"--art {art}: no art.tar.xz.part-* in it")
    return parts


def check(llama_tar: Path) -> None:
    """Configure the pruned tree (CPU only) and generate llama-ui's sources, as a build would."""
    with tempfile.TemporaryDirectory(prefix="gpu-prepare-check-") as tmp:
        with tarfile.open(llama_tar) as tar:
            tar.extractall(tmp, filter="data")
        src, build = Path(tmp) / "llama.cpp", Path(tmp) / "build"
        log = Path(tmp) / "cmake.log"
        steps = [
            ["cmake", "-S", str(src), "-B", str(build), *CHECK_FLAGS],
            ["cmake", "--build", str(build), "--target", "llama-ui-assets"],
        ]
        for argv in steps:
            with log.open("w") as out:
                done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
            text = log.read_text()
            if done.returncode != 0 or "CMake Error" in text:
                print(text[-6000:], file=sys.stderr)
                raise SystemExit(f"check failed: {' '.join(argv[:3])} ...")
        if not (build / "tools" / "ui" / "ui.cpp").exists():
            raise SystemExit("check failed: llama-ui-assets made no ui.cpp")
    print("check: the pruned llama.cpp configures and generates llama-ui's sources")


def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare(out: Path, art: list[Path]) -> None:
    if out.exists() and any(out.iterdir()) and not (out / STAMP).exists():
        raise SystemExit(f"{out} exists and was not made by this script: move it away first")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / STAMP).write_text(f"made by bench/gpu_prepare.py; llama-cpp-python {VERSION}\n")
    sdist = _sdist(cache_root())
    files = write_sources(sdist, out / "llama.cpp.tar.xz", out / "llama_cpp_py.tgz")
    print(f"from {sdist.name}: llama.cpp {files[0]} files, llama_cpp {files[1]} files")
    fetch_wheels(out / "whl")
    copy_tree(out / "wt")
    if art:
        (out / "art").mkdir()
        for part in art:
            shutil.copy2(part, out / "art" / part.name)


def report(out: Path) -> int:
    total = 0
    for name in ("llama.cpp.tar.xz", "llama_cpp_py.tgz", "whl", "wt", "art"):
        if (out / name).exists():
            n = size(out / name)
            total += n
            print(f"{n / MIB:8.2f} MiB  {out / name}")
    print(f"{total / MIB:8.2f} MiB  in all ({len(WHEELS)} wheels)")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the folder bench/gpu_run.sh reads.")
    ap.add_argument("--out", type=Path, default=REPO / ".gpu", help="the folder (GPU_DIR)")
    ap.add_argument("--art", type=Path, help="a folder holding a build's art.tar.xz.part-*")
    ap.add_argument("--check", action="store_true", help="configure the pruned llama.cpp here")
    args = ap.parse_args()
    out = args.out.resolve()
    prepare(out, art_parts(args.art) if args.art else [])
    if args.check:
        check(out / "llama.cpp.tar.xz")
    if report(out) >= SIZE_LIMIT:
        raise SystemExit(f"{out} is over {SIZE_LIMIT // MIB} MiB: a GPU call cannot carry it")


if __name__ == "__main__":
    main()
