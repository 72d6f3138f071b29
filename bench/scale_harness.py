"""The processes of a `bench.scale` run and the pipes to them: the two services, the client
processes, and, in this (mostly idle) process, the node agents of the hosts whose ranks will die,
so that the fail-stop path (silence -> report -> eviction) runs on a loop no emulation work
delays. A watchdog kills everything past the RSS cap (the machine is shared)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from fthsdp.bench.scale_agents import SideLoop, VictimHost
from fthsdp.bench.scale_emulated import ClientPlan, run_client
from fthsdp.bench.scale_model import Shape, Victim, client_replicas, host_of
from fthsdp.bench.scale_ranks import Settings
from fthsdp.bench.scale_services import (
    CentralSettings,
    ProcSample,
    QuorumSettings,
    Watchdog,
    profile_path,
    sample,
    serve_central,
    serve_quorum,
)

START_TIMEOUT_S = 60.0
MARGIN_S = 30.0
"""How much longer than a phase's own deadline a client may take to answer."""
CENTRAL_HEARTBEAT_TIMEOUT_S = 3600.0
"""The central service's own fail-stop timeout: the phases leave gaps in the node agents'
forwarding that a job does not have, and the agents find fail-stops first (the design's first
level of heartbeats); the victims' agents are real."""


class Harness:
    """Spawned processes, their pipes, and the victims' node agents."""

    def __init__(self, args: argparse.Namespace, shape: Shape, token: str) -> None:
        self.args, self.shape, self.token = args, shape, token
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, BaseProcess] = {}
        self.conns: dict[str, Connection] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self.gc: dict[str, dict[str, float]] = {}
        """Seconds each service spent in the garbage collector, per phase."""
        self.notes: list[str] = []
        self.watchdog: Watchdog | None = None
        self.side: SideLoop | None = None
        self.hosts: dict[Victim, VictimHost] = {}
        self.quorum_address = self.central_address = ""
        self.current = "start"
        """The phase under way (for a report of where a run was cut short)."""
        self._seq = 0

    def _spawn(self, name: str, target: Any, *args: Any) -> Connection:
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=target, args=(theirs, *args), daemon=True, name=name)
        proc.start()
        theirs.close()  # the child has its own; ours would keep the pipe open past its death
        self.procs[name], self.conns[name] = proc, mine
        return mine

    def start(self, victims: list[Victim], relay_hop_s: float = 0.0) -> None:
        """The services, then the client processes (their ranks hear events `relay_hop_s` a
        level of the relay tree after their leader)."""
        a = self.args
        quorum = QuorumSettings(
            heartbeat_timeout_s=a.quorum_heartbeat_timeout_ms / 1000,
            lift_world_size_cap=self.shape.ranks if a.lift_world_size_cap else None,
            profile=profile_path(a.profile, "quorum"),
        )
        q = self._spawn("quorum", serve_quorum, self.token, quorum)
        self.quorum_address = _recv(q, START_TIMEOUT_S)
        central = CentralSettings(
            hang_timeout_s=a.hang_timeout_s,
            heartbeat_timeout_s=CENTRAL_HEARTBEAT_TIMEOUT_S,
            quorum=self.quorum_address,
            profile=profile_path(a.profile, "central"),
        )
        c = self._spawn("central", serve_central, self.token, central)
        self.central_address = _recv(c, START_TIMEOUT_S)
        for k, replicas in enumerate(client_replicas(self.shape, a.clients)):
            plan = ClientPlan(
                index=k,
                quorum=self.quorum_address,
                central=self.central_address,
                token=self.token,
                shape=self.shape,
                replicas=tuple(replicas),
                settings=Settings(relay_hop_s=relay_hop_s, agent_streams=a.agent_streams),
            )
            conn = self._spawn(f"client-{k}", run_client, plan)
            if _recv(conn, START_TIMEOUT_S) != "ready":
                raise RuntimeError(f"client {k} did not start")
        pids = {name: p.pid for name, p in self.procs.items() if p.pid is not None}
        self.watchdog = Watchdog(pids, int(a.max_rss_gb * 2**30), self.kill)
        self.watchdog.start()
        self.side = SideLoop("scale-victim-agents")
        for victim in victims:
            self.hosts[victim] = self._call(self._victim_host(victim), START_TIMEOUT_S)

    async def _victim_host(self, victim: Victim) -> VictimHost:
        rph = self.shape.ranks_per_host
        first = victim.rank - victim.rank % rph
        host = VictimHost(
            host=host_of(victim.replica, victim.rank, rph),
            replica_id=victim.replica_id,
            ranks=range(first, min(first + rph, self.shape.ranks)),
            quorum=self.quorum_address,
            central=self.central_address,
            token=self.token,
            beat_s=0.2,
            hang=self.args.death == "hang",
        )
        await host.start()
        return host

    def _call(self, coro: Any, timeout_s: float) -> Any:
        assert self.side is not None
        return asyncio.run_coroutine_threadsafe(coro, self.side.loop).result(timeout_s)

    def kill_rank(self, victim: Victim) -> float:
        """Kills the victim's rank (it beats once more first); the moment it died."""
        death: float = self._call(self.hosts[victim].kill(victim.rank), 10.0)
        return death

    def reports(self, victim: Victim) -> list[tuple[float, float, str, str]]:
        """The victim agent's reports to the quorum service so far."""
        return list(self.hosts[victim].reporter.reports)

    @property
    def clients(self) -> list[str]:
        return [name for name in self.procs if name.startswith("client-")]

    def broadcast(self, command: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        """Sends `command` to every client; their answers (an error dict for one that did not
        answer in `timeout_s` + a margin)."""
        seq = self._next()
        for client in self.clients:
            with contextlib.suppress(EOFError):  # a gone client is reported as its answer below
                _send(self.conns[client], (seq, command, kwargs))
        answers = []
        for client in self.clients:
            try:
                answers.append(_reply(self.conns[client], seq, timeout_s + MARGIN_S))
            except (TimeoutError, EOFError, OSError) as exc:
                answers.append({"error": f"{client}: {type(exc).__name__} {exc}"})
        return answers

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def phase(self, name: str, command: str, timeout_s: float, **kwargs: Any) -> list[Any]:
        """`broadcast`, with every process's CPU seconds over it recorded under `name`."""
        self.current = name
        before = self.samples()
        answers = self.broadcast(command, timeout_s, **kwargs)
        self.account(name, before)
        return answers

    Samples = tuple[dict[str, ProcSample | None], dict[str, float]]

    def samples(self) -> Samples:
        """Every process's /proc counters and the services' garbage-collection seconds."""
        procs = {name: sample(p.pid) for name, p in self.procs.items() if p.pid is not None}
        return procs, self._gc_seconds()

    def _gc_seconds(self) -> dict[str, float]:
        out = {}
        for service in ("quorum", "central"):
            with contextlib.suppress(TimeoutError, EOFError, OSError, KeyError):  # it is gone
                out[service] = sum(self.ask(service, "gc", None)["seconds"])
        return out

    def account(self, phase: str, before: Samples) -> None:
        """Records what every process spent since `before`, under `phase`."""
        procs, gc = self.samples()
        for name, after in procs.items():
            start = before[0].get(name)
            if start is not None and after is not None:
                self.cpu.setdefault(name, {})[phase] = after.cpu_s - start.cpu_s
        for name, seconds in gc.items():
            if name in before[1]:
                self.gc.setdefault(name, {})[phase] = seconds - before[1][name]

    def ask(self, service: str, command: str, argument: Any) -> Any:
        """One command to a service process; EOFError if it is gone, TimeoutError if it hangs."""
        seq = self._next()
        _send(self.conns[service], (seq, command, argument))
        return _reply(self.conns[service], seq, 60.0)

    def kill(self) -> None:
        """Kills whatever process is left and closes every pipe."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for conn in self.conns.values():
            conn.close()

    def stop(self) -> dict[str, Any]:
        """Stops the clients (their final counters), the agents and the services."""
        final: dict[str, Any] = {}
        for client in self.clients:
            try:
                seq = self._next()
                _send(self.conns[client], (seq, "stop", {}))
                final[client] = _reply(self.conns[client], seq, 60.0)
            except (TimeoutError, EOFError, OSError) as exc:
                final[client] = {"error": str(exc)}
        for host in self.hosts.values():
            try:
                self._call(host.stop(), 15.0)
            except Exception as exc:
                self.notes.append(f"the agent of {host.host} did not stop cleanly: {exc!r}")
        if self.side is not None:
            self.side.close()
        for service in ("quorum", "central"):
            try:
                seq = self._next()
                _send(self.conns[service], (seq, "stop", None))
                _reply(self.conns[service], seq, 180.0)  # a profile of 98K streams takes a while
            except (TimeoutError, EOFError, OSError, KeyError) as exc:
                self.notes.append(f"{service} did not stop cleanly: {exc!r}")
        if self.watchdog is not None:
            self.watchdog.stop()
        for proc in self.procs.values():
            proc.join(10)
        self.kill()
        return final


def _send(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError) as exc:
        raise EOFError(f"process gone: {exc}") from exc


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer in {timeout_s:g} s")
    return conn.recv()


def _reply(conn: Connection, seq: int, timeout_s: float) -> Any:
    """The answer to request `seq`; a late answer to an earlier request (one given up on) is
    dropped, so answers never slip onto the wrong phase."""
    deadline = time.monotonic() + timeout_s
    while True:
        tag, answer = _recv(conn, max(0.0, deadline - time.monotonic()))
        if tag == seq:
            return answer
