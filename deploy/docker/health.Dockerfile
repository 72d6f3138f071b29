# syntax=docker/dockerfile:1
# The fthsdp health service (central detectors + dashboard, or a node agent). Build from the
# repository root:
#   docker build -f deploy/docker/health.Dockerfile -t fthsdp-health .
#
# Base image: pinned by exact tag. For a reproducible production build pin its digest too:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.14-slim-trixie@sha256:<digest> ...
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# fthsdp/ is the installed namespace: its __init__ and links to the directories copied here
COPY fthsdp/ fthsdp/
COPY protos/ protos/
COPY services/ services/
COPY deploy/__init__.py deploy/probe.py deploy/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 fthsdp \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin fthsdp
COPY deploy/docker/requirements-services.txt /tmp/requirements.txt
COPY --from=build /wheels /tmp/wheels
RUN pip install -r /tmp/requirements.txt /tmp/wheels/*.whl && rm -rf /tmp/wheels /tmp/requirements.txt
USER 10001:10001
WORKDIR /tmp
EXPOSE 7460 7461
# Drains on SIGTERM itself and forks nothing: PID 1 without an init is correct.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "fthsdp.deploy.probe", "http://127.0.0.1:7461/readyz"]
ENTRYPOINT ["python", "-m", "fthsdp.services.health"]
# Central mode on 0.0.0.0 (reachable on the container network); the quorum list and Redis URL
# come from the deployment (compose command, Kubernetes args).
CMD ["--mode", "central", "--host", "0.0.0.0", "--port", "7460", "--http-port", "7461"]
