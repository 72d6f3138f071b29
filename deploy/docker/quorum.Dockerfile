# syntax=docker/dockerfile:1
# The fthsdp quorum service. Build from the repository root:
#   docker build -f deploy/docker/quorum.Dockerfile -t fthsdp-quorum .
#
# Base image: pinned by exact tag. For a reproducible production build pin its digest too:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.14-slim-trixie@sha256:<digest> ...
# (`docker buildx imagetools inspect python:3.11.14-slim-trixie` prints the digest).
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
# The project itself, without its dependencies (the service list below has no torch).
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
EXPOSE 7450 7451
# The service drains on SIGTERM itself (health NOT_SERVING, stop accepting, grace, exit), so it
# runs as PID 1 directly; it forks nothing, so there are no zombies to reap.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "fthsdp.deploy.probe", "http://127.0.0.1:7451/livez"]
ENTRYPOINT ["fthsdp-quorum"]
# 0.0.0.0 on purpose: inside a container the service must be reachable on the container network.
# The token comes from FTHSDP_TOKEN (an env file) or FTHSDP_TOKEN_FILE (a mounted secret).
CMD ["--host", "0.0.0.0", "--port", "7450", "--admin-port", "7451"]
