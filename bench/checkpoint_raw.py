"""The raw-TCP references of `bench.checkpoint` and the CPU accounting of both sides.

A reference sender is a process per source: it maps the snapshot's shm file and answers each
connection's request (offset, count as two u64) with those bytes, by `sendall` from the mapping
(a plain user-space copy, the issue's "raw TCP copy") or by `socket.sendfile` (the kernel-only
ceiling). The receiver opens `connections` connections spread over the sources, as the fetch does,
and `recv_into`s disjoint ranges of one buffer: no HTTP, no checksum."""

from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SENDER = r"""
import mmap, os, socket, struct, sys, threading
path, mode, nice = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.nice(nice)  # as niced as the sidecars it stands for
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
data = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
source = os.fdopen(fd, "rb", buffering=0)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
print(srv.getsockname()[1], flush=True)

def serve(conn):
    with conn:
        head = conn.recv(16, socket.MSG_WAITALL)
        offset, count = struct.unpack("<QQ", head)
        if mode == "sendfile":
            conn.sendfile(source, offset, count)
        else:
            conn.sendall(data[offset:offset + count])

while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
MODES = ("sendall", "sendfile")


def process_cpu(pid: int) -> float:
    """CPU-seconds (user + system) a process has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed transfer: wall seconds and CPU-seconds of the receiver and of the senders."""

    seconds: float
    client_cpu: float
    server_cpu: float
    checksum_s: float = 0.0
    """Of the client's time, spent checksumming (what `transfer` returned)."""


class CpuMeter:
    """CPU-seconds of this process and of `servers` over a timed block."""

    def __init__(self, servers: Sequence[int]) -> None:
        self.servers = list(servers)

    def run(self, transfer: Callable[[], float]) -> Sample:
        """Times `transfer`, which returns the seconds it spent checksumming (0: none)."""
        server0 = sum(process_cpu(p) for p in self.servers)
        client0, start = self_cpu(), time.perf_counter()
        checksum_s = transfer()
        seconds = time.perf_counter() - start
        client = self_cpu() - client0
        server = sum(process_cpu(p) for p in self.servers) - server0
        return Sample(seconds, client, server, checksum_s)


class RawSenders:
    """One sender process per snapshot file, all in one mode."""

    def __init__(self, files: Sequence[Path], mode: str, nice: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.procs: list[subprocess.Popen[str]] = []
        self.ports: list[int] = []
        try:
            for path in files:
                proc = subprocess.Popen(
                    [sys.executable, "-c", SENDER, str(path), mode, str(nice)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                self.procs.append(proc)
                assert proc.stdout is not None
                self.ports.append(int(proc.stdout.readline()))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def copy(self, into: memoryview, sources: int, connections: int) -> None:
        """Fills `into` over `connections` connections to the first `sources` senders."""
        size = len(into)
        bounds = [size * i // connections for i in range(connections + 1)]
        errors: list[BaseException] = []

        def pull(i: int) -> None:
            try:
                start, stop = bounds[i], bounds[i + 1]
                port = self.ports[i % sources]
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(struct.pack("<QQ", start, stop - start))
                    view = into[start:stop]
                    got = 0
                    while got < len(view):
                        n = sock.recv_into(view[got:])
                        if not n:
                            raise RuntimeError("a raw sender closed early")
                        got += n
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
