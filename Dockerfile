# syntax=docker/dockerfile:1.7
# One image for every accelstack process; pick the process with the command:
#   accelstack-device-plugin | accelstack-extender | accelstack-nr1-cni | accelstack-npd-* | accelstack
# Multi-stage: wheels are built in a full Python image, the runtime image has no compiler and runs as non-root
# (uid 65532) unless a manifest asks for root (the device plugin writes sockets into a root-owned hostPath).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir --upgrade pip wheel
COPY pyproject.toml README.md ./
COPY device_plugin ./device_plugin
COPY scheduler_extender ./scheduler_extender
COPY npd ./npd
COPY cni ./cni
COPY protos ./protos
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="accelstack" \
      org.opencontainers.image.description="Fair, safe sharing of NVIDIA GPUs and NeuReality NR1 modules on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 accelstack && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin accelstack
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-compile /wheels/*.whl && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
ENTRYPOINT []
CMD ["accelstack-extender", "--help"]
