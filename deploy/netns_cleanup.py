"""Ownership and removal of network-namespace topologies (`deploy.netns`): who made each one,
whether its maker still lives, and removal that leaves nothing behind.

Every topology has an id, `<prefix><6 hex digits>` (`fth3fa9c2`). Its namespaces are
`<id>` (the bridge) and `<id>-<host>`; every link it makes lives inside them and carries the id in
its name. Before it makes its first namespace, the maker writes an owner record,
`/run/fthsdp-netns/<id>.json`: its pid and that process's start time (so a recycled pid never
passes for the maker). A topology is *stale* when its maker is gone; `cleanup_stale` removes only
stale ones, so a test session never tears down a topology another live session (another
engineer's run on a shared machine) is using.

Removal kills every process inside the namespaces before deleting them: a deleted namespace that
a process still sits in lives on, unnamed, with its links. The processes are found the way
`ip netns pids` finds them, by the namespace's inode in `/proc/<pid>/ns/net`, and removal checks
that none is left afterwards. A process that enters one of the namespaces while it is being
removed is killed by the second sweep (after the names are gone, nobody can enter any more)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "fth"
"""Default first letters of every topology id, namespace and link name."""
NETNS_DIR = Path("/run/netns")
"""Where `ip netns add` mounts named namespaces."""
RECORDS_DIR = Path("/run/fthsdp-netns")
"""Owner records, one `<id>.json` per topology."""
ID_HEX_DIGITS = 6
_PREFIX_PATTERN = re.compile(r"^[a-z]{1,5}$")
_COMMAND_TIMEOUT_S = 20.0
_KILL_WAIT_S = 10.0


class NetnsError(Exception):
    """Root of the errors of the namespace topology."""


class CommandFailed(NetnsError):
    """An `ip` or `tc` command exited non-zero."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"`{' '.join(argv)}` exited {returncode}: {self.stderr}")


class CleanupError(NetnsError):
    """Something of a topology could not be removed (its message says what is left)."""


def check_prefix(prefix: str) -> str:
    """`prefix` if it is 1-5 lower-case letters (ids and link names must fit IFNAMSIZ)."""
    if not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"prefix must be 1-5 lower-case letters, got {prefix!r}")
    return prefix


def id_pattern(prefix: str) -> re.Pattern[str]:
    """Matches a namespace name of a topology made with `prefix`; group 1 is the topology id."""
    check_prefix(prefix)
    return re.compile(rf"^({prefix}[0-9a-f]{{{ID_HEX_DIGITS}}})(?:-[a-z0-9-]+)?$")


def command(argv: Sequence[str], *, stdin: str | None = None) -> str:
    """Runs an `ip`/`tc` command line; its stdout, or CommandFailed with its stderr."""
    result = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
    )
    if result.returncode != 0:
        raise CommandFailed(argv, result.returncode, result.stderr)
    return result.stdout


# ---- owners ---------------------------------------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the name (field 2) may hold spaces and parentheses, so count from its end.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    """Who made a topology."""

    topology_id: str
    pid: int
    start_time: int
    hosts: tuple[str, ...]

    @property
    def path(self) -> Path:
        return RECORDS_DIR / f"{self.topology_id}.json"

    def alive(self) -> bool:
        """Whether the maker still runs (the same process, not a recycled pid)."""
        return process_start_time(self.pid) == self.start_time

    def write(self) -> None:
        RECORDS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        body = {"pid": self.pid, "start_time": self.start_time, "hosts": list(self.hosts)}
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(body))
        staging.replace(self.path)

    @classmethod
    def mine(cls, topology_id: str, hosts: Sequence[str]) -> OwnerRecord:
        """A record naming this process as the maker."""
        pid = os.getpid()
        start = process_start_time(pid)
        assert start is not None  # this process exists
        return cls(topology_id=topology_id, pid=pid, start_time=start, hosts=tuple(hosts))

    @classmethod
    def read(cls, topology_id: str) -> OwnerRecord | None:
        """The record of `topology_id`; None if it has none (or an unreadable one)."""
        try:
            body = json.loads((RECORDS_DIR / f"{topology_id}.json").read_text())
            return cls(
                topology_id=topology_id,
                pid=int(body["pid"]),
                start_time=int(body["start_time"]),
                hosts=tuple(str(h) for h in body["hosts"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def new_id(prefix: str) -> str:
    """A fresh topology id: `prefix` and random hex digits no namespace here starts with."""
    while True:
        topology_id = prefix + secrets.token_hex(ID_HEX_DIGITS // 2)
        if not any(name.startswith(topology_id) for name in _listdir(NETNS_DIR)):
            return topology_id


def _listdir(path: os.PathLike[str]) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


# ---- what exists ----------------------------------------------------------------------------


def namespaces(prefix: str = PREFIX) -> dict[str, list[str]]:
    """Named namespaces made with `prefix`, by topology id (the bridge namespace last)."""
    pattern = id_pattern(prefix)
    found: dict[str, list[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(NETNS_DIR)):
            match = pattern.fullmatch(name)
            if match:
                found.setdefault(match.group(1), []).append(name)
    for names in found.values():
        names.sort(key=lambda n: "-" not in n)  # hosts first: deleting one also drops its port
    return found


def records(prefix: str = PREFIX) -> list[str]:
    """Topology ids that have an owner record."""
    pattern = id_pattern(prefix)
    with contextlib.suppress(FileNotFoundError):
        return sorted(
            p.stem for p in RECORDS_DIR.glob("*.json") if pattern.fullmatch(p.stem) is not None
        )
    return []


def root_links(prefix: str = PREFIX) -> list[str]:
    """Links in this (the machine's) namespace named like a topology's: there should never be
    any, since both ends of every veth are made inside the topology's namespaces."""
    pattern = re.compile(rf"^{check_prefix(prefix)}[0-9a-f]{{{ID_HEX_DIGITS}}}")
    out = command(["ip", "-o", "link", "show"])
    names = (line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines())
    return sorted(name for name in names if pattern.match(name))


def leftovers(prefix: str = PREFIX, *, owner: int | None = None) -> list[str]:
    """Namespaces, owner records and root-namespace links made with `prefix` that nobody alive
    owns; with `owner`, also those owned by that live process (a session that should have
    removed its own). Topologies of other live processes are not leftovers."""
    found: list[str] = []
    by_id = namespaces(prefix)
    for topology_id in sorted(set(by_id) | set(records(prefix))):
        record = OwnerRecord.read(topology_id)
        if record is not None and record.alive() and record.pid != owner:
            continue
        found += by_id.get(topology_id, []) or [f"{topology_id} (owner record only)"]
    found += [f"link {name}" for name in root_links(prefix)]
    return found


# ---- removal --------------------------------------------------------------------------------


def namespace_inode(name: str) -> int | None:
    """The inode identifying named namespace `name`, None if it does not exist."""
    try:
        return (NETNS_DIR / name).stat().st_ino
    except OSError:
        return None


def holders(inodes: Iterable[int]) -> dict[int, int]:
    """Processes whose network namespace is one of `inodes`: pid → inode."""
    wanted = {f"net:[{inode}]": inode for inode in inodes}
    found: dict[int, int] = {}
    if not wanted:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            link = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a zombie: it holds no namespace any more
            continue
        if link in wanted:
            found[int(entry)] = wanted[link]
    return found


def kill_holders(inodes: Iterable[int], *, wait_s: float = _KILL_WAIT_S) -> None:
    """SIGKILLs every process inside the namespaces `inodes` and waits until none is left."""
    inodes = set(inodes)
    deadline = time.monotonic() + wait_s
    while found := holders(inodes):
        for pid in found:
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise CleanupError(f"processes {sorted(found)} did not leave their namespaces")
        time.sleep(0.01)


def destroy(topology_id: str, names: Sequence[str]) -> None:
    """Removes a topology: kills what runs in its namespaces, deletes them (which deletes every
    link inside: a veth goes with either end), then its owner record. Safe to repeat."""
    inodes = {inode for name in names if (inode := namespace_inode(name)) is not None}
    errors: list[str] = []
    try:
        kill_holders(inodes)
    except CleanupError as exc:
        errors.append(str(exc))
    for name in names:
        if namespace_inode(name) is None:
            continue
        try:
            command(["ip", "netns", "delete", name])
        except CommandFailed as exc:
            if namespace_inode(name) is not None:  # not a concurrent removal of the same one
                errors.append(str(exc))
    try:
        kill_holders(inodes)  # anyone who entered between the first sweep and the deletion
    except CleanupError as exc:
        errors.append(str(exc))
    if errors:
        raise CleanupError(f"topology {topology_id} not fully removed: {'; '.join(errors)}")
    (RECORDS_DIR / f"{topology_id}.json").unlink(missing_ok=True)


def cleanup_stale(prefix: str = PREFIX, *, owner: int | None = None) -> list[str]:
    """Removes the topologies made with `prefix` whose maker is gone (a crashed or SIGKILLed
    test run), and any root-namespace link named like one; returns the ids removed. Live
    topologies are left alone, except, with `owner`, those of that process (a test session
    removing what it failed to close)."""
    removed: list[str] = []
    by_id = namespaces(prefix)
    for topology_id in sorted(set(by_id) | set(records(prefix))):
        record = OwnerRecord.read(topology_id)
        if record is not None and record.alive() and record.pid != owner:
            continue
        destroy(topology_id, by_id.get(topology_id, []))
        removed.append(topology_id)
    for name in root_links(prefix):
        command(["ip", "link", "delete", name])
    return removed
