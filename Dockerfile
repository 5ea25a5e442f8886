# syntax=docker/dockerfile:1.7
# One image for every accelstack process; pick the process with the command:
#   accelstack-device-plugin | accelstack-extender | accelstack-nr1-cni | accelstack-npd-* | accelstack
#   | accelstack-gateway | accelstack-inference-operator
# Multi-stage: wheels are built in a full Python image, the runtime image has no compiler and runs as non-root
# (uid 65532) unless a manifest asks for root (the device plugin writes sockets into a root-owned hostPath).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip wheel
COPY pyproject.toml README.md ./
COPY device_plugin ./device_plugin
COPY service ./service
COPY scheduler_extender ./scheduler_extender
COPY npd ./npd
COPY cni ./cni
COPY protos ./protos
COPY kubeapi ./kubeapi
COPY inference ./inference
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="accelstack" \
      org.opencontainers.image.description="Fair, safe sharing of NVIDIA GPUs and NeuReality NR1 modules on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 accelstack && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin accelstack
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-compile /wheels/*.whl && rm -rf /wheels
# A relocatable copy of the interpreter with accelstack installed, for the CNI installer to put on the host
# (/opt/cni/bin/accelstack-nr1-cni.d): the official images link python with rpath $ORIGIN/../lib, and Python
# finds its home from bin/../lib/python3.11, so the tree runs from wherever it is copied.
RUN set -eu; v=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'); \
    mkdir -p /opt/accelstack/bin /opt/accelstack/lib; \
    cp -L "/usr/local/bin/python$v" /opt/accelstack/bin/python3; \
    cp -a /usr/local/lib/libpython"$v"*.so* /opt/accelstack/lib/; \
    cp -a "/usr/local/lib/python$v" /opt/accelstack/lib/; \
    rm -rf "/opt/accelstack/lib/python$v/test" "/opt/accelstack/lib/python$v/idlelib" \
           "/opt/accelstack/lib/python$v/tkinter" "/opt/accelstack/lib/python$v/ensurepip"; \
    /opt/accelstack/bin/python3 -I -c 'import cni, device_plugin, grpc'  # the copy stands on its own
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
ENTRYPOINT []
CMD ["accelstack-extender", "--help"]
