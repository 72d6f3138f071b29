# syntax=docker/dockerfile:1
# A training replica: torchrun over W ranks of the demo job (`deploy/demo/train.py`), CPU torch.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t fthsdp-worker .
#
# Base image: pinned by exact tag. For a reproducible production build pin its digest too:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.14-slim-trixie@sha256:<digest> ...
# For GPUs build FROM a CUDA runtime image and install the matching torch wheel instead.
ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# fthsdp/ is the installed namespace: its __init__ and links to the directories copied here
COPY fthsdp/ fthsdp/
COPY protos/ protos/
COPY services/ services/
COPY worker/ worker/
COPY deploy/ deploy/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# tini: torchrun forks the rank processes; as PID 1 an init reaps any orphan and forwards
# SIGTERM to torchrun, which stops its ranks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 fthsdp \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/fthsdp \
       --shell /usr/sbin/nologin fthsdp \
    && mkdir -p /data/shm /data/run \
    && chown -R 10001:10001 /data
# The CPU build of torch first: a bare `torch` requirement would resolve to a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=build /wheels /tmp/wheels
RUN pip install /tmp/wheels/*.whl && rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /data
STOPSIGNAL SIGTERM
# A replica is healthy while its leader keeps committing steps (one JSON line each): a stale log
# means a hang. FTHSDP_REPLICA_ID names the replica (the deployment sets it).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD python -m fthsdp.deploy.probe --fresh "/data/run/replicas/${FTHSDP_REPLICA_ID:-r0}.jsonl" --max-age-s 300
ENTRYPOINT ["tini", "--", "torchrun"]
CMD ["--help"]
