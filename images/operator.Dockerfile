# Ember operator image. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ember/operator .
# BASE_IMAGE: any Debian-bookworm-based image with python3 + the venv module (the default is the
# public slim Python image; the local cluster passes one built from Debian packages).
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
    /opt/ember/bin/pip install /src

FROM ${BASE_IMAGE}
COPY --from=build /opt/ember /opt/ember
# Read-only root filesystem friendly: no .pyc writes, temp files only under a mounted /tmp.
ENV PATH=/opt/ember/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# A named non-root user: Kopf (getpass) and others look the uid up in /etc/passwd.
RUN echo 'ember:x:65532:65532:ember:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'ember:x:65532:' >> /etc/group
USER 65532:65532
ENTRYPOINT ["python3", "-m", "ember_operator"]
