"""The command-line conventions every fthsdp service shares: flags that fall back to a
`FTHSDP_<SERVICE>_<FLAG>` environment variable (flag > env > default), millisecond flags turned
into `timedelta`, the `--token-file` / `--log-level` pair, and one logging setup. Only a service's
`__main__` uses it: nothing else reads the environment."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

Flag = tuple[str, str, Callable[[str], Any], str]
"""(flag without dashes, config field, parser of the text, help)."""


def env_name(prefix: str, flag: str) -> str:
    """`FTHSDP_QUORUM_` + `heartbeat-timeout-ms` -> `FTHSDP_QUORUM_HEARTBEAT_TIMEOUT_MS`."""
    return prefix + flag.upper().replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, prefix: str, flags: Sequence[Flag]) -> None:
    """One option per flag (default None, so the environment can fill it in), then the token
    and log-level options every service has."""
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
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, ... [env FTHSDP_LOG_LEVEL]")


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


def setup_logging(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Logging at `--log-level`, else FTHSDP_LOG_LEVEL, else INFO."""
    logging.basicConfig(
        level=(args.log_level or env.get("FTHSDP_LOG_LEVEL") or "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
