# Ember NPU device plugin image (DaemonSet). Build from the repository root:
#   docker build -f images/deviceplugin.Dockerfile -t ember/deviceplugin .
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# A build behind a TLS-intercepting proxy passes its CA bundle as the optional secret `pip-ca`
# (`--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt`); without it pip uses its own.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/ember
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY runtime /src/runtime
# The gRPC stubs are generated at build time from the .proto files, never committed.
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    /opt/ember/bin/pip install grpcio-tools==1.85.* mypy-protobuf==5.1.* \
 && cd /src && PYTHONPATH=runtime /opt/ember/bin/python -m ember_runtime.deviceplugin.api.generate \
 && /opt/ember/bin/pip install '/src[deviceplugin]' \
 && /opt/ember/bin/pip uninstall -y grpcio-tools mypy-protobuf

FROM ${BASE_IMAGE}
COPY --from=build /opt/ember /opt/ember
ENV PATH=/opt/ember/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# uid 0 with every capability dropped, no privilege escalation and a read-only root filesystem
# (the DaemonSet sets them): the kubelet's device-plugins dir is root:root 0750 and its sockets
# 0755, so only their owner may create the plugin's socket and dial the kubelet's. The chart's
# deviceplugin-daemonset.yaml and docs/privileges.md say why in full.
ENTRYPOINT ["python3", "-m", "ember_runtime.deviceplugin"]
