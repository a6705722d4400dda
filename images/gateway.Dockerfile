# Ember site gateway image: one OpenAI endpoint for every model of a site (docs/gateway.md).
#   make images   (or: buildah bud -f images/gateway.Dockerfile -t ember-gateway .)
# No engine, no llama.cpp: the `gateway` extra is the runtime's HTTP stack only, so the image
# is small and builds in seconds for any architecture (`--platform linux/arm64` as it is).
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# A build behind a TLS-intercepting proxy passes its CA bundle as the optional secret `pip-ca`
# (`--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt`); without it pip uses its own.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/ember
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY runtime /src/runtime
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/ember/bin/pip install '/src[gateway]'

FROM ${BASE_IMAGE}
COPY --from=build /opt/ember /opt/ember
# Read-only root filesystem friendly: no .pyc writes; it writes no files at all.
ENV PATH=/opt/ember/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN echo 'ember:x:65532:65532:ember:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'ember:x:65532:' >> /etc/group
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["python3", "-m", "ember_runtime.gateway"]
