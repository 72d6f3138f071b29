"""The command-line conventions every fthsdp service shares: flags that fall back to a
`FTHSDP_<SERVICE>_<FLAG>` environment variable (flag > env > default), millisecond flags turned
into `timedelta`, the `--token-file` / `--log-level` / `--log-format` options, and one logging
setup (`services.common.logs`). Only a service's `__main__` uses it: nothing else reads the
environment."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

from fthsdp.services.common import logs

Flag = tuple[str, str, Callable[[str], Any], str]
"""(flag without dashes, config field, parser of the text, help)."""


def env_name(prefix: str, flag: str) -> str:
    """`FTHSDP_QUORUM_` + `heartbeat-timeout-ms` -> `FTHSDP_QUORUM_HEARTBEAT_TIMEOUT_MS`."""
    return prefix + flag.upper().replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, prefix: str, flags: Sequence[Flag]) -> None:
    """One option per flag (default None, so the environment can fill it in), then the token
    and logging options every service has."""
    for flag, _, kind, text in flags:
        parser.add_argument(
            f"--{flag}", type=kind, default=None, help=f"{text} [env {env_name(prefix, flag)}]"
        )
    parser.add_argument(
        "--token-file",
        default=None,
        help="file holding the bearer token [env FTHSDP_TOKEN_FILE, "
        "or the token itself in FTHSDP_TOKEN]",
    )
    add_logging_flags(parser)


def add_logging_flags(parser: argparse.ArgumentParser, *, level_default: str = "INFO") -> None:
    """`--log-level` and `--log-format`, read by `setup_logging` (env FTHSDP_LOG_LEVEL and
    FTHSDP_LOG_FORMAT: one setting for every process of a job)."""
    parser.add_argument(
        "--log-level",
        default=None,
        help=f"DEBUG, INFO, ... (default {level_default}) [env FTHSDP_LOG_LEVEL]",
    )
    add_log_format_flag(parser)


def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    """`--log-format` alone, for a process whose log level is part of its own config."""
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=None,
        help="text: time, level, logger, message, then key=value context; json: one object "
        "per line (default text) [env FTHSDP_LOG_FORMAT]",
    )


def flag_or_env(
    args: argparse.Namespace,
    env: Mapping[str, str],
    prefix: str,
    flag: str,
    kind: Callable[[str], Any],
) -> Any:
    """The flag's value, else the parsed environment variable, else None; ValueError names the
    variable when its text does not parse."""
    raw: Any = getattr(args, flag.replace("-", "_"))
    if raw is None:
        name = env_name(prefix, flag)
        if env.get(name, "") != "":
            try:
                raw = kind(env[name])
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    return raw


def config_values(
    args: argparse.Namespace,
    env: Mapping[str, str],
    prefix: str,
    flags: Sequence[Flag],
    *,
    milliseconds: Collection[str] = (),
    off_when_negative: Collection[str] = (),
) -> dict[str, Any]:
    """Config fields from flags and environment (fields given neither are left out, so the
    config's defaults apply). Millisecond fields become `timedelta`; a negative value of an
    `off_when_negative` field (a port) becomes None."""
    values: dict[str, Any] = {}
    for flag, field, kind, _ in flags:
        raw = flag_or_env(args, env, prefix, flag, kind)
        if raw is None:
            continue
        if field in milliseconds:
            raw = timedelta(milliseconds=raw)
        if field in off_when_negative and raw < 0:
            raw = None
        values[field] = raw
    return values


def setup_logging(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    level_default: str = "INFO",
    fields: Mapping[str, Any] | None = None,
) -> None:
    """Logging at `--log-level`, else FTHSDP_LOG_LEVEL, else `level_default`, in the format of
    `--log-format`, else FTHSDP_LOG_FORMAT, else text. ValueError (naming the variable) for an
    unknown level or format."""
    level = getattr(args, "log_level", None) or env.get("FTHSDP_LOG_LEVEL") or level_default
    fmt = getattr(args, "log_format", None) or env.get("FTHSDP_LOG_FORMAT") or "text"
    try:
        logs.parse_level(level)
    except ValueError as exc:
        where = "--log-level" if getattr(args, "log_level", None) else "FTHSDP_LOG_LEVEL"
        raise ValueError(f"{where}: {exc}") from None
    if fmt not in logs.FORMATS:
        choices = ", ".join(logs.FORMATS)
        raise ValueError(f"FTHSDP_LOG_FORMAT: must be one of {choices}, got {fmt!r}")
    logs.configure(level, fmt, fields=fields)
