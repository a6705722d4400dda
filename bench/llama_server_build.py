"""Build llama.cpp's own `llama-server` from the sources vendored in llama-cpp-python's sdist.

Same llama.cpp commit as the Python bindings Ember uses, so the benchmark compares servers, not
llama.cpp versions. Cached under `${XDG_CACHE_HOME:-~/.cache}/ember/llama-server/`.

    python bench/llama_server_build.py        # prints the binary's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build tries to download the web UI
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember" / "llama-server"


def _sources(root: Path) -> Path:
    src = root / f"llama_cpp_python-{VERSION}"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return src
    sdist_dir = root / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    archive = sdist_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={VERSION}", "-d", str(sdist_dir)], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return src


def ensure_llama_server(jobs: int = 2) -> Path:
    root = cache_root()
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    llama_cpp = _sources(root) / "vendor" / "llama.cpp"
    build = root / "build"
    subprocess.run(["cmake", "-S", str(llama_cpp), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True
    )
    if not binary.exists():
        raise FileNotFoundError(f"the build finished but {binary} is missing")
    return binary


if __name__ == "__main__":
    print(ensure_llama_server())
