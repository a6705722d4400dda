#!/usr/bin/env bash
# Build llama.cpp's CUDA backend (libllama for llama-cpp-python, and llama-server) from the
# sources vendored in llama-cpp-python's sdist, on the GPU machine, for one architecture.
#
#   bench/gpu_build.sh SRC_TARBALL BUILD_DIR [CUDA_ARCH]
#
# One build serves both servers: llama-cpp-python's ctypes bindings load the libllama.so built
# here (LLAMA_CPP_LIB_PATH), and llama-server links the same libllama/libggml, so the benchmark
# compares servers, not builds. The flags are llama-cpp-python's CUDA build
# (CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90") plus the server target.
set -euo pipefail
src_tar=$1
build=$2
arch=${3:-90}
jobs=${JOBS:-$(nproc)}
work=$(dirname "$build")/llama-src
mkdir -p "$work"
tar -C "$work" -xJf "$src_tar"
started=$(date +%s)
cmake -S "$work/llama.cpp" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON \
  -DGGML_CUDA=on \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$build.configure.log"
cmake --build "$build" --target llama llama-server -j "$jobs" >"$build.build.log" 2>&1 \
  || { tail -40 "$build.build.log"; exit 1; }
echo "built llama.cpp (CUDA sm_$arch) in $(( $(date +%s) - started )) s"
ls -la "$build/bin"
