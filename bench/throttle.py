"""Slows one replica of a running demo by a factor f, for real: `bench.failslow`'s fail-slow host.

The replica's processes are found by their command line: every `python -m
fthsdp.deploy.demo.train ... --replica-id rX` (its ranks; a warm spare, `--spare`, belongs to no
replica until it takes over, and its command line never says which) plus all their descendants
(DataLoader workers). The supervisor restarts a torn-down replica with new pids, so the set is
scanned again every `RESCAN_S`; a restarted replica on a slow host is slow again.

Three ways to slow it, the first available taken (`choose_backend`):

- `cgroup` (cgroup v2 with the cpu controller at `/sys/fs/cgroup`, writable) and `cgroup-v1`
  (the v1 cpu controller at `/sys/fs/cgroup/cpu`, writable; the same CFS bandwidth limit): the
  processes move into a cgroup of their own, limited to 1/f of the CPU they used before the
  first slowdown (`calibration`: their CPU seconds per second while the factor was 1). A
  quota caps CPU whatever the others do, so a replica whose peers wait on it stays slow: a
  slow host does not speed up when its job idles.
- `signals` (anywhere): SIGSTOP/SIGCONT duty cycling, stopped 1 - 1/f of the time in cycles of
  `period_s` (60 ms: stops of 40 ms at f = 3, far below the 200 ms heartbeat period, so the
  replica is slow, never dead); each cycle's stop is corrected by what the previous ones
  overshot, so the stopped share is 1 - 1/f over time even on a loaded machine. It is what the
  demo's own `--kill-mode slow` does, with f chosen. It is work-conserving on the CPU: on a
  machine where the replicas share cores, a stopped replica leaves CPU to the others and, while
  they wait on it, runs faster than before, so its work can slow far less than f.

Either way the achieved slowdown must be measured from the replica's own step times, which
`bench.failslow` does; `ReplicaThrottle.report` gives what the throttle applied and the CPU the
replica used at each factor.

Every stop is undone: each SIGSTOP is followed by a SIGCONT within the cycle, `close` continues
every process it ever saw and moves cgroup members back where they came from. Only a bench
SIGKILLed mid-stop leaves a replica stopped (`kill -CONT` it) or in its cgroup."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
TRAIN_MODULE = "fthsdp.deploy.demo.train"
"""The module every demo rank runs (`python -m fthsdp.deploy.demo.train`)."""
DEFAULT_PERIOD_S = 0.06
"""One stop/continue cycle of the `signals` backend."""
RESCAN_S = 0.5
"""How often the replica's processes are looked up again (restarts bring new pids)."""
CPU_PERIOD_US = 10_000
"""`cpu.max` period of the `cgroup` backend: short against a step (a demo step is ~100 ms), so
the limit holds within each step. With 100 ms a step whose work fitted in one period's quota
ran at full speed and then idled at the exchange: a replica given fewer micro-steps looked
healthy again, and the planner gave them back."""
MIN_QUOTA_US = 1_000
"""The kernel refuses a `cpu.max` quota below 1 ms."""
TICK_S = 0.25
"""How often the cgroup backends sample CPU use (the signals backend samples every cycle)."""
MAX_STOP_S = 0.1
"""The longest single stop of the signals backend, whatever correction it owes."""

Backend = Literal["signals", "cgroup", "cgroup-v1"]


# ---------------------------------------------------------------------------------------------
# Pure parts


def duty_cycle(factor: float, period_s: float = DEFAULT_PERIOD_S) -> tuple[float, float]:
    """(running, stopped) seconds of one cycle that slows a CPU-bound process `factor` times: it
    runs 1/factor of every period."""
    if not factor >= 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if not period_s > 0:
        raise ValueError(f"period_s must be positive, got {period_s}")
    running = period_s / factor
    return running, period_s - running


def next_stop(
    factor: float, period_s: float, elapsed_s: float, stopped_s: float, cap_s: float = MAX_STOP_S
) -> float:
    """The stop of the next cycle that brings the stopped share since the factor was set
    (`stopped_s` of `elapsed_s`) to 1 - 1/factor by the cycle's end: the nominal stop plus what
    earlier cycles fell short (late wake-ups lengthen the running part), within [0, cap_s]."""
    share = 1.0 - 1.0 / factor
    want = share * (elapsed_s + period_s) - stopped_s
    return min(max(want, 0.0), max(cap_s, duty_cycle(factor, period_s)[1]))


def quota_us(
    factor: float, natural_cores: float | None, period_us: int = CPU_PERIOD_US
) -> int | None:
    """The CFS quota per `period_us` that grants 1/factor of `natural_cores` (the CPU the
    processes used unthrottled); None (no limit) at factor 1 or before any use was measured."""
    if not factor >= 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if factor == 1.0 or natural_cores is None or natural_cores <= 0:
        return None
    return max(MIN_QUOTA_US, round(natural_cores / factor * period_us))


def cpu_max(quota: int | None, period_us: int = CPU_PERIOD_US) -> str:
    """A cgroup v2 `cpu.max` line."""
    return f"{'max' if quota is None else quota} {period_us}"


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One process as /proc shows it."""

    pid: int
    ppid: int
    argv: tuple[str, ...]


def parse_cmdline(raw: bytes) -> tuple[str, ...]:
    """A /proc/<pid>/cmdline: NUL-separated arguments (empty for a kernel thread or a zombie)."""
    return tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)


def _stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/<pid>/stat line after the command name, which sits in parentheses
    and may hold spaces and parentheses itself: counted from the last ')'."""
    return stat[stat.rindex(")") + 2 :].split()


def parse_ppid(stat: str) -> int:
    """The parent pid from a /proc/<pid>/stat line."""
    return int(_stat_fields(stat)[1])


def is_rank_of(argv: Iterable[str], replica_id: str) -> bool:
    """Whether a command line is a rank of `replica_id`: `-m fthsdp.deploy.demo.train` with
    `--replica-id replica_id` (or `--replica-id=...`), and not a warm spare."""
    args = list(argv)
    runs_train = any(a == "-m" and b == TRAIN_MODULE for a, b in itertools.pairwise(args))
    if not runs_train or "--spare" in args:
        return False
    for i, a in enumerate(args):
        if a == "--replica-id" and i + 1 < len(args) and args[i + 1] == replica_id:
            return True
        if a == f"--replica-id={replica_id}":
            return True
    return False


def replica_pids(procs: Mapping[int, ProcInfo], replica_id: str) -> set[int]:
    """The ranks of `replica_id` and all their descendants (DataLoader workers, whatever they
    spawn)."""
    found = {pid for pid, p in procs.items() if is_rank_of(p.argv, replica_id)}
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def read_procs(root: Path = PROC) -> dict[int, ProcInfo]:
    """Every process under `root` (a /proc); ones that end while being read are left out."""
    out: dict[int, ProcInfo] = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = parse_cmdline((entry / "cmdline").read_bytes())
            ppid = parse_ppid((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = ProcInfo(pid=int(entry.name), ppid=ppid, argv=argv)
    return out


def process_state(pid: int, root: Path = PROC) -> str | None:
    """The one-letter state of a process (R, S, T for stopped, ...); None once it is gone."""
    try:
        return _stat_fields((root / str(pid) / "stat").read_text())[0]
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int, root: Path = PROC) -> float | None:
    """User + system CPU seconds a process has used; None once it is gone."""
    try:
        fields = _stat_fields((root / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None
    # utime and stime are fields 14 and 15 of proc(5)'s stat, 12 and 13 after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cgroup_path(text: str, version: Literal[1, 2]) -> str:
    """A process's cgroup in the v2 hierarchy (`0::/path`) or the v1 cpu one (`4:cpu,cpuacct:/p`)
    from its /proc/<pid>/cgroup."""
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == 2 and hid == "0" and controllers == "":
            return path
        if version == 1 and "cpu" in controllers.split(","):
            return path
    return "/"


def choose_backend(root: Path = CGROUP_ROOT) -> Backend:
    """`cgroup` where `root` is a cgroup v2 hierarchy offering the cpu controller, `cgroup-v1`
    where `root/cpu` is the v1 cpu controller, either writable by this process; `signals`
    otherwise (a read-only mount, no privilege, no cgroups)."""
    with contextlib.suppress(OSError):
        controllers = (root / "cgroup.controllers").read_text().split()
        if "cpu" in controllers and os.access(root, os.W_OK):
            return "cgroup"
    v1 = root / "cpu"
    if (v1 / "cpu.cfs_quota_us").is_file() and os.access(v1, os.W_OK):
        return "cgroup-v1"
    return "signals"


# ---------------------------------------------------------------------------------------------
# The throttle


@dataclass(slots=True)
class _Applied:
    """What the throttle applied while one factor was set."""

    seconds: float = 0.0
    stopped_s: float = 0.0
    throttled_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds the replica's processes used meanwhile."""


class _Cgroup:
    """The CFS bandwidth files of one cgroup of ours, v2 or v1."""

    def __init__(self, backend: Backend, root: Path, name: str) -> None:
        self.version: Literal[1, 2] = 2 if backend == "cgroup" else 1
        self.hierarchy = root if self.version == 2 else root / "cpu"
        if self.version == 2:
            control = root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        self.path = self.hierarchy / name
        self.path.mkdir(exist_ok=True)
        self.origins: dict[int, str] = {}
        self.limit(None)

    def limit(self, quota: int | None) -> None:
        if self.version == 2:
            (self.path / "cpu.max").write_text(cpu_max(quota))
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(-1 if quota is None else quota))

    def throttled_s(self) -> float:
        stat: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    stat[key] = int(value)
        if self.version == 2:
            return stat.get("throttled_usec", 0) / 1e6
        return stat.get("throttled_time", 0) / 1e9

    def adopt(self, pids: Iterable[int]) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                origin = cgroup_path((PROC / str(pid) / "cgroup").read_text(), self.version)
                (self.path / "cgroup.procs").write_text(str(pid))
                self.origins.setdefault(pid, origin)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.limit(None)
        # Processes forked inside it since (and not adopted by a scan) go to the root.
        with contextlib.suppress(OSError):
            for raw in (self.path / "cgroup.procs").read_text().split():
                self.origins.setdefault(int(raw), "/")
        mine = "/" + str(self.path.relative_to(self.hierarchy))
        for pid, origin in self.origins.items():
            origin = "/" if origin == mine else origin
            for dest in (self.hierarchy / origin.lstrip("/"), self.hierarchy):
                try:
                    (dest / "cgroup.procs").write_text(str(pid))
                    break
                except OSError:  # gone, or its old cgroup is
                    continue
        try:
            self.path.rmdir()
        except OSError as exc:  # a member that could not be moved out keeps it
            log.warning("could not remove %s: %s", self.path, exc)


class ReplicaThrottle:
    """Slows one replica by `set_factor(f)` from a thread of this process until `close`.

    `find` returns the pids to throttle (default: `replica_pids` of `replica_id` from /proc);
    tests pass their own. Use as a context manager, or `start` and `close` (idempotent). The
    cgroup backends calibrate on the CPU the processes use while the factor is 1 before the
    first slowdown: give them a few seconds of it."""

    def __init__(
        self,
        replica_id: str,
        *,
        backend: Backend | Literal["auto"] = "auto",
        period_s: float = DEFAULT_PERIOD_S,
        rescan_s: float = RESCAN_S,
        find: Callable[[], set[int]] | None = None,
        cgroup_root: Path = CGROUP_ROOT,
    ) -> None:
        duty_cycle(1.0, period_s)  # validates the period
        self.replica_id = replica_id
        self.backend: Backend = choose_backend(cgroup_root) if backend == "auto" else backend
        self._period_s = period_s
        self._rescan_s = rescan_s
        self._find = find or (lambda: replica_pids(read_procs(), replica_id))
        self._cgroup_root = cgroup_root
        self._cgroup: _Cgroup | None = None
        self._factor = 1.0
        self._lock = threading.Lock()
        self._pids: set[int] = set()
        self._seen: set[int] = set()
        self._applied: dict[float, _Applied] = {}
        self._cpu: dict[int, float] = {}
        """CPU seconds of each process at the last sample."""
        self._calibration = [0.0, 0.0]
        """CPU seconds and wall seconds at factor 1 before the first slowdown."""
        self._natural_cores: float | None = None
        self._quota: int | None = None
        self._throttled_total = 0.0
        """cgroups: the kernel's throttled seconds at the last sample."""
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"throttle-{replica_id}", daemon=True
        )
        self._closed = False

    def __enter__(self) -> ReplicaThrottle:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def factor(self) -> float:
        return self._factor

    @property
    def pids(self) -> set[int]:
        """The processes throttled now (as of the last scan)."""
        with self._lock:
            return set(self._pids)

    def start(self) -> None:
        if self.backend != "signals":
            name = f"fthsdp-throttle-{self.replica_id}-{os.getpid()}"
            self._cgroup = _Cgroup(self.backend, self._cgroup_root, name)
        self._thread.start()

    def set_factor(self, factor: float) -> None:
        """Slows the replica `factor` times from the next cycle on (1: not at all)."""
        duty_cycle(factor, self._period_s)
        self._factor = factor

    def close(self) -> None:
        """Stops throttling (idempotent): every process seen is continued, cgroup members go
        back to their own cgroups and the cgroup is removed."""
        if self._closed:
            return
        self._closed = True
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            seen = set(self._seen)
        _signal(seen, signal.SIGCONT)
        if self._cgroup is not None:
            self._cgroup.remove()

    def report(self) -> dict[str, Any]:
        """Per factor: seconds at it, the replica's CPU cores used, and for `signals` the share
        of the time stopped (the nominal slowdown is 1 / (1 - share)), for the cgroups the
        kernel's throttled seconds and the calibrated CPU the quota is a fraction of."""
        with self._lock:
            per_factor = {}
            for f, a in sorted(self._applied.items()):
                per_factor[f"{f:g}"] = {
                    "seconds": round(a.seconds, 3),
                    "cores": round(a.cpu_s / a.seconds, 4) if a.seconds else None,
                    "stopped_share": round(a.stopped_s / a.seconds, 4) if a.seconds else None,
                    "throttled_s": round(a.throttled_s, 3),
                }
            return {
                "backend": self.backend,
                "replica": self.replica_id,
                "period_s": self._period_s,
                "processes_seen": len(self._seen),
                "natural_cores": self._natural_cores,
                "calibration_s": round(self._calibration[1], 3),
                "quota_us": self._quota,
                "per_factor": per_factor,
            }

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        next_scan = 0.0
        last = time.monotonic()
        epoch = [self._factor, 0.0, 0.0]  # factor, seconds, stopped seconds since it was set
        try:
            while not self._done.is_set():
                if time.monotonic() >= next_scan:
                    self._rescan()
                    next_scan = time.monotonic() + self._rescan_s
                factor = self._factor
                if factor != epoch[0]:
                    epoch = [factor, 0.0, 0.0]
                if self.backend == "signals":
                    stopped = self._signal_cycle(factor, epoch[1], epoch[2])
                else:
                    stopped = 0.0
                    self._limit(factor)
                    self._done.wait(TICK_S)
                now = time.monotonic()
                self._account(factor, now - last, stopped)
                epoch[1] += now - last
                epoch[2] += stopped
                last = now
        except Exception:
            log.exception("throttle of %s failed; it stops throttling", self.replica_id)
        finally:
            with self._lock:
                pids = set(self._seen)
            _signal(pids, signal.SIGCONT)

    def _rescan(self) -> None:
        try:
            pids = self._find()
        except OSError as exc:
            log.warning("could not scan for %s's processes: %s", self.replica_id, exc)
            return
        with self._lock:
            new = pids - self._seen
            self._pids = pids
            self._seen |= pids
        if new:
            log.info("throttle %s: %d new process(es)", self.replica_id, len(new))
            if self._cgroup is not None:
                self._cgroup.adopt(new)

    def _account(self, factor: float, dt: float, stopped: float) -> None:
        """Adds a cycle or tick to the factor's record, with the CPU the processes used in it
        (those alive at both samples)."""
        now_cpu = {pid: c for pid in self.pids if (c := cpu_seconds(pid)) is not None}
        used = sum(c - self._cpu[pid] for pid, c in now_cpu.items() if pid in self._cpu)
        self._cpu = now_cpu
        throttled = 0.0
        if self._cgroup is not None:
            total = self._cgroup.throttled_s()
            throttled, self._throttled_total = total - self._throttled_total, total
        with self._lock:
            applied = self._applied.setdefault(factor, _Applied())
            applied.seconds += dt
            applied.stopped_s += stopped
            applied.cpu_s += used
            applied.throttled_s += max(0.0, throttled)
            if factor == 1.0 and self._natural_cores is None:
                self._calibration[0] += used
                self._calibration[1] += dt

    def _limit(self, factor: float) -> None:
        """cgroups: the quota for `factor`; the first slowdown ends the calibration."""
        assert self._cgroup is not None
        if factor > 1.0 and self._natural_cores is None:
            cpu_s, wall_s = self._calibration
            self._natural_cores = cpu_s / wall_s if wall_s > 0 else None
            if self._natural_cores is None:
                log.warning("throttle %s: slowed before any calibration; no limit", self.replica_id)
        quota = quota_us(factor, self._natural_cores)
        if quota != self._quota:
            self._cgroup.limit(quota)
            self._quota = quota

    def _signal_cycle(self, factor: float, elapsed_s: float, stopped_s: float) -> float:
        """One cycle; returns the seconds the processes were stopped."""
        if factor <= 1.0:
            self._done.wait(self._period_s)
            return 0.0
        running, _ = duty_cycle(factor, self._period_s)
        stop = next_stop(factor, self._period_s, elapsed_s, stopped_s)
        pids = self.pids
        t0 = time.monotonic()
        if stop > 0:
            _signal(pids, signal.SIGSTOP)
            try:
                self._done.wait(stop)
            finally:
                _signal(pids, signal.SIGCONT)
        spent = time.monotonic() - t0
        self._done.wait(running)
        return spent


def _signal(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
