"""`python -m fthsdp.services.checkpoint` / `fthsdp-checkpoint`: run one checkpoint sidecar.

Precedence: flag > FTHSDP_CHECKPOINT_<FLAG> env > default. Prints `listening on <url>` once bound
(port 0 picks a free port). SIGTERM/SIGINT drain and stop; a second SIGINT exits at once."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.common import gc_tuning, logs
from fthsdp.services.common.cli import add_log_format_flag
from fthsdp.services.common.tokens import load_token

ENV_PREFIX = "FTHSDP_CHECKPOINT_"

# flag, config field, type, converter to the config's unit, help
_FLAGS: list[tuple[str, str, Callable[[str], Any], Callable[[Any], Any], str]] = [
    ("--host", "host", str, str, "interface to bind (default 127.0.0.1)"),
    ("--port", "port", int, int, "TCP port, 0 for a free one (default 0)"),
    (
        "--shm-dir",
        "shm_dir",
        str,
        Path,
        "private directory publishers write snapshots to (default /dev/shm/fthsdp-<uid>)",
    ),
    ("--durable-dir", "durable_root", str, Path, "root of durable checkpoints and data positions"),
    (
        "--retain-snapshots",
        "retain_snapshots",
        int,
        int,
        "published steps kept per rank (default 2)",
    ),
    (
        "--retain-checkpoints",
        "retain_checkpoints",
        int,
        int,
        "complete durable steps kept (default 3)",
    ),
    ("--chunk-bytes", "chunk_bytes", int, int, "checksum chunk size in bytes (default 4 MiB)"),
    ("--max-range-bytes", "max_range_bytes", int, int, "largest range per request (256 MiB)"),
    ("--max-body-bytes", "max_body_bytes", int, int, "largest request body, bytes (16 MiB)"),
    ("--checksum-threads", "checksum_threads", int, int, "threads computing checksums (default 2)"),
    (
        "--checksum-wait-ms",
        "checksum_wait",
        int,
        lambda ms: timedelta(milliseconds=ms),
        "how long a manifest request waits for checksums, ms (default 30000)",
    ),
    (
        "--shutdown-grace-ms",
        "shutdown_grace",
        int,
        lambda ms: timedelta(milliseconds=ms),
        "drain time on shutdown, ms (default 5000)",
    ),
    (
        "--send-with",
        "send_with",
        str,
        str,
        "how snapshot bytes go out: write (kernel copy) or sendfile (no copy here; default write)",
    ),
    ("--log-level", "log_level", str, str, "critical|error|warning|info|debug (default warning)"),
    (
        "--redis-url",
        "redis_url",
        str,
        str,
        "keep data positions in Redis, redis://[:password@]host:port/db (default: files)",
    ),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fthsdp-checkpoint", description=__doc__)
    for flag, _, kind, _, text in _FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    add_log_format_flag(parser)
    parser.add_argument("--token-file", default=None, help="file holding the bearer token")
    parser.add_argument(
        "--nice",
        type=int,
        default=None,
        help="CPU niceness added to the sidecar process (default 10: serving yields to training)",
    )
    return parser


def config_from(args: argparse.Namespace, env: dict[str, str]) -> CheckpointConfig:
    """The config from parsed flags, then FTHSDP_CHECKPOINT_* env, then the defaults."""
    values: dict[str, Any] = {}
    for flag, field_name, kind, convert, _ in _FLAGS:
        raw = getattr(args, flag[2:].replace("-", "_"))
        env_name = ENV_PREFIX + flag[2:].replace("-", "_").upper()
        if raw is None and env.get(env_name):
            try:
                raw = kind(env[env_name])
            except ValueError as exc:
                raise ValueError(f"{env_name}: {exc}") from exc
        if raw is not None:
            values[field_name] = convert(raw)
    return CheckpointConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    try:
        config = config_from(args, env)
        token = load_token(path=args.token_file, env=env)
        fmt = args.log_format or env.get("FTHSDP_LOG_FORMAT") or "text"
        if fmt not in logs.FORMATS:
            raise ValueError(f"FTHSDP_LOG_FORMAT: must be one of {', '.join(logs.FORMATS)}")
    except (ValueError, OSError) as exc:
        print(f"fthsdp-checkpoint: {exc}", file=sys.stderr)
        return 2
    level = "INFO" if config.log_level in ("info", "debug", "trace") else config.log_level
    logs.configure(level, fmt)
    nice = args.nice if args.nice is not None else int(env.get(ENV_PREFIX + "NICE", "10"))
    if nice:
        os.nice(nice)
    server = CheckpointServer(config, token)
    stop = threading.Event()

    def on_signal(signum: int, _: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            os._exit(130)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        url = server.start()
    except ValueError as exc:  # an unsafe shm dir
        print(f"fthsdp-checkpoint: {exc}", file=sys.stderr)
        return 2
    gc_tuning.settle()
    print(f"fthsdp-checkpoint listening on {url}", flush=True)
    try:
        while not stop.wait(3600):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
