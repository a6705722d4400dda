# Ember — every command a developer or CI needs. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PY_SYS   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
APT_PKGS := containerd runc containernetworking-plugins debootstrap iproute2 \
            iptables util-linux gcc g++ libc6-dev cmake buildah
# `make arm64-proof` only: emulation to run arm64 images, the cross toolchain for llama.cpp.
ARM64_APT_PKGS := qemu-user-static binfmt-support gcc-aarch64-linux-gnu g++-aarch64-linux-gnu
# llama.cpp is compiled once (≈6 min) into a wheel cached by version and compiler flags
# (images/llama_build.py --wheel); pip must install that wheel, never its own build.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2
# `make images` / `make push`: names are $(REGISTRY)/ember-<name>:$(TAG), what the chart renders
# from image.registry / image.tag (TAG defaults to the chart's appVersion, the chart's default).
REGISTRY   ?=
TAG        ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/ember/Chart.yaml)
PLATFORM   ?=
BASE_IMAGE ?=
# The build needs only the standard library (and buildah); BASE_IMAGE=local (the local cluster's
# Debian base, no registry needed) needs the venv.
IMAGE_PY    = $(if $(wildcard $(PY)),$(PY),$(PY_SYS))
IMAGE_ARGS  = --registry '$(or $(REGISTRY),ember.local)' --tag '$(TAG)' $(if $(DRY_RUN),--dry-run) \
              $(if $(PLATFORM),--platform '$(PLATFORM)') $(if $(BASE_IMAGE),--base-image '$(BASE_IMAGE)') \
              $(if $(ONLY),--only $(ONLY))
ifneq ($(filter push,$(MAKECMDGOALS)),)
ifeq ($(REGISTRY),)
$(error make push needs REGISTRY=host[:port]/path, e.g. REGISTRY=registry.example:5000/ember)
endif
endif

.PHONY: help install apt protos test test-unit lint crds crds-check cluster-build cluster-up \
        cluster-down cluster-status demo bench drills e2e e2e-kind docker clean llama-server images push \
        arm64-proof

help: ## this list
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

apt: ## Debian packages the local cluster needs (root)
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml images/llama_build.py
	$(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	wheel=$$($(PY) images/llama_build.py --wheel) && \
	  $(PY) -m pip install -q --force-reinstall --no-deps "$$wheel"
	$(PY) -m pip install -q --only-binary llama-cpp-python -e '.[dev]'
	touch $@

install: apt $(STAMP) protos ## Python env (.venv), Debian packages, generated gRPC stubs

protos: $(STAMP) ## generate the device plugin's gRPC stubs from the .proto files
	$(PY) -m ember_runtime.deviceplugin.api.generate

lint: install ## ruff + mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check operator runtime tests bench images
	$(VENV)/bin/mypy operator runtime tests bench images

crds: install ## regenerate crds/ (and the chart's copy) from the pydantic models
	$(PY) -m ember_operator.api.crdgen
	$(PY) -m ember_operator.api.docgen
	rm -f charts/ember/crds/*.yaml && cp crds/*.yaml charts/ember/crds/

crds-check: install ## fail when the committed CRDs (or the chart's copy) differ from the models
	$(PY) -m ember_operator.api.crdgen --check
	$(PY) -m ember_operator.api.docgen --check
	diff -ru crds charts/ember/crds

images: ## build every image in images/ with buildah: REGISTRY=… TAG=… PLATFORM=linux/arm64 BASE_IMAGE=local
	$(IMAGE_PY) -m images.build build $(IMAGE_ARGS)

push: images ## buildah push each image to $(REGISTRY)/ember-<name>:$(TAG) (after `buildah login`)
	$(IMAGE_PY) -m images.build push $(IMAGE_ARGS)

arm64-proof: install ## build the images for linux/arm64 here and run them under qemu (→ bench/results/arm64.*)
	@$(MAKE) --no-print-directory apt APT_PKGS='$(ARM64_APT_PKGS)'
	@# A VM without systemd leaves binfmt_misc unmounted, and then no handler is registered.
	@[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
	@[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
	$(PY) -m tests.arm64.proof --build --write-results

cluster-build: install ## build/cache Kubernetes, kwok, helm and the local images
	$(PY) -m tests.cluster build

cluster-up: cluster-build ## start the local real cluster (control plane, kwok, kubelet node)
	$(PY) -m tests.cluster up

cluster-down: ## stop the local cluster and clean up
	$(PY) -m tests.cluster down

cluster-status: ## which cluster components run
	$(PY) -m tests.cluster status

llama-server: install ## build llama.cpp's own server (the runtime's peer in tests and bench), cached
	$(PY) images/llama_build.py

test: install cluster-build llama-server lint crds-check docker ## the whole suite CI runs
	$(VENV)/bin/pytest -p no:cacheprovider -ra --durations=25

test-unit: install ## tests that need no cluster
	$(VENV)/bin/pytest -p no:cacheprovider -ra -m "not cluster and not node"

demo: cluster-up ## the main job: local cluster + Ember + a small model answering a request
	$(PY) -m tests.demo

e2e: install cluster-up ## Helm → operator + device plugin → prewarm → runtime → chat → thermal, on the local cluster
	EMBER_KEEP_CLUSTER=1 $(VENV)/bin/pytest -p no:cacheprovider -ra -m "not kind" tests/e2e

docker: ## a Docker engine for the kind e2e: none needed where one answers, else Debian's docker.io
	@docker info >/dev/null 2>&1 || command -v dockerd >/dev/null || \
	  $(MAKE) --no-print-directory apt APT_PKGS=docker.io

e2e-kind: install cluster-build docker ## the same flow on a two-node kind cluster (kind and its node image built here; see README)
	$(PY) -m tests.e2e.kind

bench: install cluster-build ## the benchmarks (figures printed side by side)
	$(PY) bench/run_all.py

drills: install cluster-build ## fault drills at full size: operator kill -9, kubelet restarts, runtime overload, fuzzed specs, broken model files (→ bench/results/drills.*)
	EMBER_DRILL_SCALE=full $(VENV)/bin/pytest -p no:cacheprovider -ra -s --timeout 3600 tests/drills

clean: cluster-down
	rm -rf $(VENV) build *.egg-info
