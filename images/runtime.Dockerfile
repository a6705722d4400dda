# Ember runtime image: the prewarm init container and the token-serving sidecar.
#   make images   (or: buildah bud -f images/runtime.Dockerfile -t ember-runtime .)
# One image for CPU, NVIDIA GPU and Ascend NPU nodes: the `runtime` extra carries nvidia-ml-py
# for the NVML temperature sensor (the driver's libnvidia-ml.so.1 comes from the node, mounted
# by the NVIDIA container toolkit); npu-smi comes from the node's Ascend driver mount.
# llama.cpp is compiled for the target architecture without -march=native, so the image runs on
# every CPU of that architecture. LLAMA_CMAKE_ARGS picks the instruction set baseline:
#   x86-64 (default): AVX2/FMA/F16C, what every x86 edge server of the last decade has.
#   arm64 (Jetson Orin, RK3588): --build-arg LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"
#   and build with `docker buildx build --platform linux/arm64` (emulated or on an arm64 builder).
#   `make images PLATFORM=linux/arm64` instead cross-compiles llama.cpp on the host with those
#   flags (images/llama_build.py) and hands the wheel in: LLAMA_WHEELS, a folder of the build
#   context pip takes llama-cpp-python from, LLAMA_PIP_ARGS=--only-binary=llama-cpp-python so it
#   never falls back to compiling under emulation, and BUILD_PACKAGES empty (no compiler needed).
# NVIDIA GPUs (llama.cpp's CUDA backend, `runtimeGpuImage` in the chart): BUILD_IMAGE a CUDA
# devel image, RUN_IMAGE the matching CUDA runtime image, LLAMA_CMAKE_ARGS with
# -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=...; exact commands for x86-64 and Jetson in
# docs/gpu.md. BUILD_IMAGE and RUN_IMAGE default to BASE_IMAGE (the CPU image).
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
ARG BUILD_IMAGE=${BASE_IMAGE}
ARG RUN_IMAGE=${BASE_IMAGE}

FROM ${BUILD_IMAGE} AS build
# A build behind a TLS-intercepting proxy passes its CA bundle as the optional secret `pip-ca`
# (`--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt`); without it pip uses its own.
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
ARG BUILD_PACKAGES="gcc g++ make cmake"
ARG LLAMA_WHEELS=images/wheels/none
ARG LLAMA_PIP_ARGS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 CMAKE_BUILD_PARALLEL_LEVEL=2
# CUDA and L4T bases have no Python: the distribution's, which the run stage installs too (the
# venv links to it by path).
RUN pkgs="${BUILD_PACKAGES}"; \
    if ! python3 -m venv --help >/dev/null 2>&1; then pkgs="$pkgs python3 python3-venv"; fi; \
    if [ -n "$pkgs" ]; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/ember
COPY ${LLAMA_WHEELS}/ /wheels/
# Its own layer: the llama.cpp compile (minutes) is cached while Ember's code changes.
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" /opt/ember/bin/pip install --find-links /wheels \
      ${LLAMA_PIP_ARGS} llama-cpp-python==0.3.36
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY runtime /src/runtime
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/ember/bin/pip install '/src[runtime]'

FROM ${RUN_IMAGE}
# llama.cpp's CPU backend uses OpenMP at run time.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 \
 && if ! command -v python3 >/dev/null; then \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3; \
    fi \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/ember /opt/ember
# The libstdc++ llama.cpp was linked against is loaded before anything else. Python extensions
# that bundle their own (older) libstdc++ otherwise load it first, and llama.cpp's model-info
# logging (std::ostream) then segfaults at model load: seen with the CUDA build on an H200
# (bench/gpu_run.sh does the same there). On the CPU base it is the library the process would
# load anyway. The link keeps ENV static across architectures (x86_64/aarch64 lib paths).
RUN lib=$(ldd /opt/ember/lib/python3*/site-packages/llama_cpp/lib/libllama.so \
      | awk '/libstdc\+\+/ {print $3}') \
 && test -n "$lib" && ln -s "$lib" /opt/ember/libstdc++-llama.so.6
ENV PATH=/opt/ember/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    LD_PRELOAD=/opt/ember/libstdc++-llama.so.6
# A named non-root user: Kopf (getpass) and others look the uid up in /etc/passwd.
RUN echo 'ember:x:65532:65532:ember:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'ember:x:65532:' >> /etc/group
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["python3", "-m", "ember_runtime.server"]
