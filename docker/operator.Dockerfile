# The Ketch operator image: `ketch-operator` without PaddlePaddle, which the operator never
# imports. Built from the repository root:
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/ketch-dev/ketch-operator:0.1.0 .
#
# manifests/base/deployment.yaml runs it as user 1000 with a read-only root filesystem.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
RUN python -m venv /opt/ketch
WORKDIR /src
COPY . .
# Ketch itself without its dependencies (they include the CPU paddlepaddle wheel), then what
# ketch.operator imports at run time. Keep these in step with pyproject.toml;
# tests/operator/test_manifests.py checks that they are.
RUN /opt/ketch/bin/pip install --no-cache-dir --no-deps . \
 && /opt/ketch/bin/pip install --no-cache-dir \
        "kopf>=1.38" \
        "aiohttp>=3.9" \
        "pyyaml>=6" \
        "prometheus-client>=0.20" \
        "jsonschema>=4.20" \
        "cel-python>=0.5"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/ketch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/ketch /opt/ketch
RUN groupadd --gid 1000 ketch \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin ketch
USER 1000:1000
# /metrics and /healthz
EXPOSE 8080
CMD ["ketch-operator", "run"]
