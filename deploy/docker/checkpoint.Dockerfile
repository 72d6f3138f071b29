# syntax=docker/dockerfile:1
# The fthsdp checkpoint service (one per host: it serves the snapshots that the ranks on its host
# publish into the shared --shm-dir). Build from the repository root:
#   docker build -f deploy/docker/checkpoint.Dockerfile -t fthsdp-checkpoint .
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
       --shell /usr/sbin/nologin fthsdp \
    && mkdir -p /data/shm /data/checkpoints \
    && chown -R 10001:10001 /data
COPY deploy/docker/requirements-services.txt /tmp/requirements.txt
COPY --from=build /wheels /tmp/wheels
RUN pip install -r /tmp/requirements.txt /tmp/wheels/*.whl && rm -rf /tmp/wheels /tmp/requirements.txt
USER 10001:10001
WORKDIR /data
# Named volumes mounted under /data start owned by the fthsdp user (Docker copies the image's
# ownership into an empty named volume).
EXPOSE 7470
# Drains on SIGTERM itself and forks nothing: PID 1 without an init is correct.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "fthsdp.deploy.probe", "http://127.0.0.1:7470/readyz"]
ENTRYPOINT ["fthsdp-checkpoint"]
# Port 7470, not the service's own default: the health service's central default is 7460/7461,
# and on a host that runs both (Slurm's first node, `fthsdp up`) they must not collide.
CMD ["--host", "0.0.0.0", "--port", "7470", "--shm-dir", "/data/shm", \
     "--durable-dir", "/data/checkpoints"]
