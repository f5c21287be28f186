# The Ketch engine image for NVIDIA GPUs: `ketch serve`, and `ketch fetch-model` for the operator's
# model-fetch init container. The operator sets every container's command (`ketch serve`, ...),
# so the image has no ENTRYPOINT. Built from the repository root:
#
#   docker build -f docker/engine.Dockerfile -t ghcr.io/ketch-dev/ketch-engine:0.1.0 .
#
# Base image: Paddle's own GPU images (paddlepaddle/paddle:<version>-gpu-cuda12.6-cudnn9.5) are
# Ubuntu 22.04 with Python 3.10, and Ketch needs Python >= 3.11. So the default base is plain
# Python, and paddlepaddle-gpu comes from Paddle's CUDA 12.6 wheel index: those wheels pull the
# CUDA and cuDNN libraries in as pip packages, and the node's NVIDIA container runtime supplies
# the driver. Any Debian-based image with Python >= 3.11 works as BASE_IMAGE; PADDLE_INDEX picks
# the CUDA build of the wheel (the node's driver must support that CUDA version).
ARG BASE_IMAGE=python:3.11-slim
ARG PADDLE_INDEX=https://www.paddlepaddle.org.cn/packages/stable/cu126/

FROM ${BASE_IMAGE} AS build
ARG PADDLE_INDEX
RUN python -m venv /opt/ketch
WORKDIR /src
COPY . .
# pyproject.toml is the one list of dependencies: paddlepaddle-gpu from the `gpu` extra instead
# of the CPU paddlepaddle wheel, every other dependency, and the `fetch` extra for
# `ketch fetch-model`.
RUN /opt/ketch/bin/python -c 'import tomllib; \
p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
open("/tmp/gpu.txt", "w").write("\n".join(p["optional-dependencies"]["gpu"])); \
deps = [d for d in p["dependencies"] if not d.startswith("paddlepaddle")]; \
open("/tmp/deps.txt", "w").write("\n".join(deps + p["optional-dependencies"]["fetch"]))' \
 && /opt/ketch/bin/pip install --no-cache-dir --index-url "${PADDLE_INDEX}" -r /tmp/gpu.txt \
 && /opt/ketch/bin/pip install --no-cache-dir -r /tmp/deps.txt \
 && /opt/ketch/bin/pip install --no-cache-dir --no-deps . \
 && { /opt/ketch/bin/python -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope' \
      || /opt/ketch/bin/pip install --no-cache-dir --force-reinstall --no-deps \
           "opentelemetry-proto==$(/opt/ketch/bin/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"; }
# (the last step: xds-protos ships an old opentelemetry/proto/ copy that may overwrite
# opentelemetry-proto's files, which the OTLP exporters of --otlp-traces-endpoint cannot load)
# Ketch's C++ CPU kernels (paged attention, fused ops, the OpenBLAS GEMM), compiled once here so
# that no pod compiles them at start-up (HOME is an emptyDir, the root filesystem read-only):
# KETCH_EXTENSION_DIR below points the engine at them. Needs g++ and the Python headers in this
# stage only. (Not built in this project's CI, which has no Docker engine.)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && KETCH_EXTENSION_DIR=/opt/ketch/extensions /opt/ketch/bin/python -m ketch.kernels.cpp_ops \
 && rm -rf /var/lib/apt/lists/*

FROM ${BASE_IMAGE}
# libgomp: OpenMP runtime that Paddle's libraries link against (not in the slim images).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/ketch/bin:$PATH \
    KETCH_EXTENSION_DIR=/opt/ketch/extensions \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /opt/ketch /opt/ketch
RUN groupadd --gid 1000 ketch \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin ketch
USER 1000:1000
# OpenAI API, /health, /ready and /metrics
EXPOSE 8000
CMD ["ketch", "--help"]
