"""The directory that holds snapshot files in shared memory, private to the user the services and
ranks run as.

Whoever can write into it can name a file there for the checkpoint sidecar to adopt (and later
delete), or swap a publisher's file under it; so it is created with mode 0700, and an existing one
is used only when it is a real directory of this user that no one else may write to."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

SHM_ROOT = Path("/dev/shm")


def default_shm_dir() -> Path:
    """`/dev/shm/fthsdp-<uid>`: one private directory per user, shared by the sidecar and the
    ranks of that user on the host."""
    return SHM_ROOT / f"fthsdp-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """Creates `path` with mode 0700 (parents as needed) if it is missing; raises ValueError if
    it is a symlink or not a directory, belongs to another user, or others may write to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} must be a directory, not a link or a file")
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"{path} is writable by other users (mode {stat.filemode(info.st_mode)}): use a "
            f"private directory such as {default_shm_dir()}, which is created with mode 0700"
        )
    return path
