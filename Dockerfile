# syntax=docker/dockerfile:1
# fleethealth images, one Dockerfile, three targets:
#
#   docker build --target probe  -t ghcr.io/fleethealth/fleethealth-probe:0.1.0 .   # GPU nodes: NVML, no chdb/torch
#   docker build --target server -t ghcr.io/fleethealth/fleethealth:0.1.0 .         # detectors, API, act
#   docker build --target sweep  -t ghcr.io/fleethealth/fleethealth-sweep:0.1.0 .   # self-test on GPUs (CuPy)
#
# The wheel is built once (stage wheel) and installed with different extras; no stage keeps the
# source tree or a compiler. Every image runs as the unprivileged user 10001 and starts
# `fleethealth`, so a manifest's args are the CLI's arguments.

# BASE: any image with Python 3.11 and pip on PATH; deploy/ci/images.sh builds every target on a
# Debian bookworm base it makes with debootstrap (no registry pull), with a venv on PATH.
ARG PYTHON=3.11
ARG BASE=python:${PYTHON}-slim

FROM ${BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleethealth fleethealth
COPY detectors detectors
COPY kernels kernels
COPY sweeps sweeps
COPY deploy/clickhouse deploy/clickhouse
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin fleethealth
COPY --from=wheel /wheels /wheels

# The node probe: the base install (numpy, orjson, kafka-python, prometheus-client) plus NVML.
# No chdb, no torch, no CuPy: it must stay small and start fast on every GPU node.
FROM runtime AS probe
RUN pip install "fleethealth[nvml] @ file://$(ls /wheels/fleethealth-*.whl)" \
    && rm -rf /wheels
USER 10001
ENTRYPOINT ["fleethealth"]

# The streaming tier and the scheduler adapter: the server extra (embedded broker and store,
# detectors, API) and the kubernetes client for `fleethealth act --scheduler kubernetes`.
FROM runtime AS server
RUN pip install "fleethealth[server,kubernetes] @ file://$(ls /wheels/fleethealth-*.whl)" \
    && rm -rf /wheels
USER 10001
EXPOSE 8080
ENTRYPOINT ["fleethealth"]

# The idle-node sweep: the known-answer tests on the GPUs need CuPy (the gpu extra); the NVIDIA
# container runtime provides the driver. Results go to Kafka and the store over the network.
FROM runtime AS sweep
RUN pip install "fleethealth[gpu,nvml] @ file://$(ls /wheels/fleethealth-*.whl)" \
    && rm -rf /wheels
USER 10001
ENTRYPOINT ["fleethealth"]
