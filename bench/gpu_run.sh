#!/usr/bin/env bash
# The GPU benchmark on the GPU machine (issues 17, 46), repeatable. GPU_DIR is made from a
# checkout by `python bench/gpu_prepare.py --out .gpu` (docs/gpu.md); then, on the GPU machine,
# from the folder that holds it:
#
#   GPU_DIR=.gpu OUT=/tmp/out BENCH=build bash .gpu/wt/bench/gpu_run.sh   # the build alone
#   GPU_DIR=.gpu OUT=/tmp/out bash .gpu/wt/bench/gpu_run.sh [TOTAL_SECONDS] # gpu_bench.py
#   GPU_DIR=.gpu OUT=/tmp/out BENCH=burst bash .gpu/wt/bench/gpu_run.sh   # gpu_burst.py instead
#   GPU_DIR=.gpu OUT=/tmp/out BENCH=plant bash .gpu/wt/bench/gpu_run.sh   # gpu_plant.py instead
#
# GPU_DIR holds what the machine cannot download: `llama.cpp.tar.xz` (llama-cpp-python's
# vendored llama.cpp, models/ docs/ tests/ and other backends removed), `llama_cpp_py.tgz`
# (the pinned llama-cpp-python's Python package, no binaries), `whl/` (wheels for the Python
# packages its image lacks: pydantic, FastAPI, uvicorn, sse-starlette, gguf, ...) and `wt/`
# (this repo's runtime/ and bench/). Optional `art/` holds a previous call's build
# (art.tar.xz.part-*), which skips the ~5 min CUDA build: without it a call builds first, and
# then the comparison (~8.5 min) no longer fits the device tool's 10 minutes. A build left in
# /tmp by an earlier call on the same (still warm) machine is used as it is. A new build's
# binaries go to $OUT/art.tar.xz.part-* when they fit. Results: $OUT/gpu_bench.{json,md,png}
# (every workload, one call) and $OUT/gpu_thermal.png when that JSON holds a thermal run.
# BENCH_ARGS go to gpu_bench.py, and `--previous GPU_DIR/prev/gpu_bench.json` too when that
# file exists: an earlier call's results, whose workloads this call does not run are kept.
set -euo pipefail
total=${1:-570}
start=$(date +%s)
gpu=$(realpath "${GPU_DIR:-.gpu}")
out=${OUT:?set OUT}
tmp=/tmp/ember-gpu
build=$tmp/build
site=$tmp/site
mkdir -p "$tmp" "$site"
# Server logs (in $OUT/work) are shown, not brought back: $OUT returns 8 files at most.
trap 'tail -n 15 "$out"/work/*.log 2>/dev/null; rm -rf "$out/work"' EXIT
nvidia-smi --query-gpu=name,driver_version,temperature.gpu,power.draw,clocks.sm --format=csv

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "$gpu"/whl/*.whl
tar -C "$site" -xzf "$gpu/llama_cpp_py.tgz"

if [ -x "$build/bin/llama-server" ] && [ -e "$build/bin/libllama.so" ]; then
  echo "using the build an earlier call left on this machine"
elif compgen -G "$gpu/art/art.tar.xz.part-*" >/dev/null; then
  mkdir -p "$build/bin"
  cat "$gpu"/art/art.tar.xz.part-* | tar -C "$build/bin" -xJf -
  echo "using the carried build"
else
  JOBS=${JOBS:-16} bash "$gpu/wt/bench/gpu_build.sh" "$gpu/llama.cpp.tar.xz" "$build" 90
  # Keep the build for a later call when it fits what comes back from $OUT (3 x 15 MiB).
  (cd "$build/bin" && tar -cf - llama-server ./*.so* | xz -T0 -6 | split -b 15M - "$out/art.tar.xz.part-")
  if [ "$(ls "$out"/art.tar.xz.part-* | wc -l)" -gt 3 ]; then
    echo "build too large to bring back: $(du -ch "$out"/art.tar.xz.part-* | tail -1)"
    rm -f "$out"/art.tar.xz.part-*
  fi
fi
# llama-cpp-python loads libllama.so (and libggml.so) from its package's lib/: the CUDA build.
ln -sfn "$build/bin" "$site/llama_cpp/lib"
export LD_LIBRARY_PATH="$build/bin:${LD_LIBRARY_PATH:-}"
# The libstdc++ llama.cpp was linked against must be the process's first: the image's Python
# extensions otherwise load another one before llama_cpp, and llama.cpp's model-info logging
# (std::ostream) segfaults in it (seen on the H200 image: crash in llama_model::print_info).
LD_PRELOAD=$(ldd "$build/bin/libllama.so" | awk '/libstdc\+\+/ {print $3}')
export LD_PRELOAD
echo "LD_PRELOAD=$LD_PRELOAD"
export PYTHONPATH="$gpu/wt/runtime:$gpu/wt:$site"
export PYTHONUNBUFFERED=1
python3 -c "import llama_cpp as l; print('llama-cpp-python', l.__version__, 'GPU offload:', l.llama_supports_gpu_offload())"

if [ "${BENCH:-}" = build ]; then  # the build only (its binaries in $OUT, above)
  exit
fi
left=$(( total - ($(date +%s) - start) - 20 ))
echo "benchmark budget: $left s"
if [ "${BENCH:-}" = burst ]; then  # first-wave TTFT only (bench/gpu_burst.py)
  python3 "$gpu/wt/bench/gpu_burst.py" --llama-server "$build/bin/llama-server" \
    --models "$tmp/models" --out "$out"
  exit
fi
if [ "${BENCH:-}" = plant ]; then  # the card's power, temperature, J/token (bench/gpu_plant.py)
  # shellcheck disable=SC2086  # PLANT_ARGS is a list of words
  python3 "$gpu/wt/bench/gpu_plant.py" --models "$tmp/models" --out "$out" --deadline "$left" \
    ${PLANT_ARGS:-}
  exit
fi
previous=()
if [ -f "$gpu/prev/gpu_bench.json" ]; then
  previous=(--previous "$gpu/prev/gpu_bench.json")
  echo "keeping the other workloads' rows of $gpu/prev/gpu_bench.json"
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words
python3 "$gpu/wt/bench/gpu_bench.py" --llama-server "$build/bin/llama-server" \
  --models "$tmp/models" --out "$out" --deadline "$left" ${previous[@]+"${previous[@]}"} \
  ${BENCH_ARGS:-}
