"""The one builder of fthsdp service command lines, for every launcher (`fthsdp up`, the demo's
`LocalStack`): `python -m fthsdp.services.<service>` with its flags, the token file and the
logging flags. Secrets never go on a command line, which every user of the host can read: the
token travels as a file, a Redis URL (it may hold a password) in the environment."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SERVICES = ("quorum", "checkpoint", "health")


def service_argv(
    python: str,
    service: str,
    *,
    token_file: Path,
    log_flags: Sequence[str] = (),
    flags: Sequence[tuple[str, object | None]] = (),
) -> list[str]:
    """The command line of `service`: each `(flag, value)` of `flags` as `--flag value`, in
    order, left out where the value is None."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {SERVICES}")
    argv = [python, "-m", f"fthsdp.services.{service}"]
    for flag, value in flags:
        if value is not None:
            argv += [flag, str(value)]
    return [*argv, "--token-file", str(token_file), *log_flags]


def log_flags(level: str | None, fmt: str | None) -> tuple[str, ...]:
    """`--log-level` / `--log-format` for every service (None: the service's own default, or
    what FTHSDP_LOG_LEVEL / FTHSDP_LOG_FORMAT say in the environment it inherits). The level is
    lower case: every service accepts that, the checkpoint sidecar (uvicorn's names) only that."""
    flags: tuple[str, ...] = ()
    if fmt is not None:
        flags += ("--log-format", fmt)
    if level is not None:
        flags += ("--log-level", level.lower())
    return flags


def redis_env(service: str, redis_url: str | None) -> dict[str, str]:
    """A service's Redis URL in its environment (`FTHSDP_<SERVICE>_REDIS_URL`), never on its
    command line."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {SERVICES}")
    return {} if redis_url is None else {f"FTHSDP_{service.upper()}_REDIS_URL": redis_url}
