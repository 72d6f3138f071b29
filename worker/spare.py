"""A warm spare's side of the takeover: wait for an identity, then become that rank.

A launcher that keeps spares (`fthsdp up --spares`, the demo's `--spares`) starts each one with
`FTHSDP_SPARE_FDS=<identity fd>,<ready fd>`: two pipe ends it inherited. The spare does what
needs no identity (import torch, build the model and optimizer, warm the allocator), then calls
`take_identity()`, which writes one line on the ready fd (the launcher counts it warm) and blocks
on the identity fd. The identity is one JSON object, at most `MAX_IDENTITY_BYTES`:

    {"env": {"FTHSDP_REPLICA_ID": "r1", "RANK": "0", ...}, "argv": [...], "log_file": "..."}

`env` goes into `os.environ` (so `dist.init_process_group()` and `ManagerConfig.from_env()` see
the rank it now is), `argv` is what the caller appends to its own arguments, and `log_file`, when
given, takes the process's stdout and stderr from then on. From there the spare is a new
incarnation of its replica like any restarted rank (I1-I6 unchanged). A launcher that closes the
identity pipe without writing one is emptying its pool: the spare exits with status 0.

Outside a spare (`FTHSDP_SPARE_FDS` unset) `take_identity()` returns None, so one script serves
as both a fresh rank and a spare. In both it first does the library's own share of the work that
needs no identity (`warm_up`: the worker's imports, torch's one-time optimizer set-up), so that
it is part of neither a spare's takeover nor a restarted rank's first step."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

SPARE_FDS_ENV = "FTHSDP_SPARE_FDS"
"""`<identity fd>,<ready fd>` in a spare's environment; unset in any other process."""
MAX_IDENTITY_BYTES = 64 * 1024
"""The longest identity a spare reads (its environment and arguments: a few hundred bytes)."""
WARM_LINE = b"warm\n"
"""What a spare writes on its ready fd once it waits for an identity."""

_warmed = False
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass(frozen=True, slots=True)
class Identity:
    """What makes a spare a rank: its environment, extra arguments and log file."""

    env: Mapping[str, str] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    log_file: str | None = None

    def encode(self) -> bytes:
        """One JSON line, as the launcher writes it."""
        body = {"env": dict(self.env), "argv": list(self.argv), "log_file": self.log_file}
        data = json.dumps(body).encode() + b"\n"
        if len(data) > MAX_IDENTITY_BYTES:
            raise ValueError(f"an identity is at most {MAX_IDENTITY_BYTES} bytes")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Identity:
        """The identity in `data`; ValueError naming what is wrong."""
        if len(data) > MAX_IDENTITY_BYTES:
            raise ValueError(f"an identity is at most {MAX_IDENTITY_BYTES} bytes")
        body = json.loads(data)
        if not isinstance(body, dict) or set(body) - {"env", "argv", "log_file"}:
            raise ValueError("an identity is an object of env, argv and log_file")
        env = body.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) and "\0" not in v
            for k, v in env.items()
        ):
            raise ValueError("an identity's env maps variable names to strings")
        argv = body.get("argv", [])
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("an identity's argv is a list of strings")
        log_file = body.get("log_file")
        if log_file is not None and (not isinstance(log_file, str) or not log_file):
            raise ValueError("an identity's log_file is a non-empty path")
        return cls(env=env, argv=tuple(argv), log_file=log_file)


def is_spare(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as a warm spare."""
    return SPARE_FDS_ENV in (os.environ if environ is None else environ)


def warm_up() -> None:
    """Pays, once per process, what the first step would otherwise pay before the rank checks
    in: importing the Manager and its clients, and torch's lazy optimizer set-up (its first
    optimizer step imports and compiles machinery: 0.4 s on a quiet host, seconds on a loaded
    one)."""
    global _warmed
    if _warmed:
        return
    import torch

    import fthsdp.worker.manager
    import fthsdp.worker.optim
    import fthsdp.worker.sampler  # noqa: F401 (imported for its cost, not its names)

    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    torch.optim.AdamW([param]).step()
    _warmed = True


def take_identity(*, warm: bool = True) -> Identity | None:
    """Warms up (`warm_up`, unless `warm` is False), then in a spare: says it is warm, blocks
    until the launcher hands it an identity, applies it (environment, log file) and returns it;
    exits (status 0) when the launcher empties its pool instead. Elsewhere: None."""
    if warm:
        warm_up()
    raw = os.environ.get(SPARE_FDS_ENV)
    if raw is None:
        return None
    identity_fd, ready_fd = _fds(raw)
    try:
        os.write(ready_fd, WARM_LINE)
    except BrokenPipeError:  # the launcher stopped reading: its identity may still come
        pass
    finally:
        os.close(ready_fd)
    data = _read_all(identity_fd)
    if not data:
        raise SystemExit(0)
    identity = Identity.decode(data)
    del os.environ[SPARE_FDS_ENV]
    os.environ.update(identity.env)
    if identity.log_file is not None:
        _redirect_output(identity.log_file)
    return identity


def _fds(raw: str) -> tuple[int, int]:
    parts = raw.split(",")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{SPARE_FDS_ENV} must be '<identity fd>,<ready fd>', got {raw!r}")
    return int(parts[0]), int(parts[1])


def _read_all(fd: int) -> bytes:
    """Everything until the launcher closes the pipe (bounded)."""
    chunks: list[bytes] = []
    size = 0
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            size += len(chunk)
            if size > MAX_IDENTITY_BYTES:
                raise ValueError(f"an identity is at most {MAX_IDENTITY_BYTES} bytes")
            chunks.append(chunk)
    return b"".join(chunks)


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
