"""Peer state fetch over loopback vs a raw TCP copy of the same bytes, and the source's stall.

    python -m bench.checkpoint --size-gb 1.0 --json bench-checkpoint.json

Starts three real sidecar processes, publishes one state of mixed tensor sizes to each (as three
replicas), then in the same run measures: a raw TCP loopback copy of those bytes (sender process
→ `recv_into` a preallocated buffer: the practical ceiling), `fetch_snapshot` from 1 source and
striped over 3 sources (into preallocated tensors, every chunk CRC-checked), and the source's
"training step" (a fixed matmul loop in the publishing process) while idle vs while a fetcher
process pulls its snapshot from the sidecar. Prints a table and writes JSON (not a pass/fail
test)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from fthsdp.services.checkpoint.client import (
    FetchedSnapshot,
    SnapshotPublisher,
    Source,
    fetch_snapshot,
    list_snapshots,
)

JOB = "bench"
STEP = 1
ROOT = Path(__file__).resolve().parents[1]

RAW_SENDER = r"""
import mmap, os, socket, sys
path, port_file = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
data = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
open(port_file + ".tmp", "w").write(str(srv.getsockname()[1]))
os.rename(port_file + ".tmp", port_file)
while True:
    conn, _ = srv.accept()
    conn.sendall(data)
    conn.close()
"""

FETCHER = r"""
import os, sys, time
os.nice(19)  # the fetcher stands for a remote host: it must not steal the source's CPU here
from datetime import timedelta
from fthsdp.services.checkpoint.client import Source, fetch_snapshot
url, token, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("started", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    fetch_snapshot([Source(url, "r0")], job="bench", rank=0, step=1, token=token,
                   deadline=timedelta(seconds=120))
"""


def make_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """Mixed sizes and dtypes, like a model + optimizer: a few big, many small tensors."""
    gen = torch.Generator().manual_seed(0)
    sizes = [64 << 20, 16 << 20, 4 << 20, 1 << 20, 256 << 10, 16 << 10]
    state: dict[str, torch.Tensor] = {}
    used, i = 0, 0
    while used < total_bytes:
        nbytes = min(sizes[i % len(sizes)], total_bytes - used)
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        numel = max(nbytes // (2 if dtype == torch.bfloat16 else 4), 1)
        state[f"t{i:05d}"] = torch.rand(numel, generator=gen).to(dtype)
        used += numel * (2 if dtype == torch.bfloat16 else 4)
        i += 1
    return state


def start_sidecar(shm: Path, durable: Path, token: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, FTHSDP_TOKEN=token, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "fthsdp.services.checkpoint", "--port", "0", "--shm-dir", str(shm)]
    cmd += ["--durable-dir", str(durable), "--retain-snapshots", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"sidecar failed to start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def raw_tcp_copy(path: Path, into: torch.Tensor, workdir: Path) -> float:
    """Seconds to copy the file's bytes over loopback TCP into `into` (best of 2)."""
    port_file = workdir / f"raw-port-{secrets.token_hex(3)}"
    sender = subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(path), str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("raw sender did not start")
            time.sleep(0.01)
        port = int(port_file.read_text())
        view = memoryview(into.numpy()).cast("B")  # type: ignore[arg-type]
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as sock:
                got = 0
                while got < len(view):
                    n = sock.recv_into(view[got:])
                    if not n:
                        raise RuntimeError("raw sender closed early")
                    got += n
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        sender.kill()
        sender.wait()


def timed_fetch(
    sources: list[Source], token: str, into: dict[str, torch.Tensor], parallel: int
) -> tuple[float, FetchedSnapshot]:
    best, result = float("inf"), None
    for _ in range(2):
        start = time.perf_counter()
        result = fetch_snapshot(
            sources,
            job=JOB,
            rank=0,
            step=STEP,
            token=token,
            into=into,
            deadline=timedelta(minutes=5),
            parallel=parallel,
        )
        best = min(best, time.perf_counter() - start)
    assert result is not None
    return best, result


def step_times(steps: int) -> list[float]:
    a = torch.rand(384, 384)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a)
        out.append(time.perf_counter() - start)
    return out


def stall(url: str, token: str, steps: int) -> dict[str, float]:
    idle = step_times(steps)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    fetcher = subprocess.Popen(
        [sys.executable, "-c", FETCHER, url, token, "600"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fetcher.stdout is not None
        fetcher.stdout.readline()
        time.sleep(1.0)  # let the fetcher get past imports and into its transfer loop
        serving = step_times(steps)
    finally:
        fetcher.kill()
        fetcher.wait()
    return {
        "idle_step_ms_median": statistics.median(idle) * 1e3,
        "serving_step_ms_median": statistics.median(serving) * 1e3,
        "idle_step_ms_p90": sorted(idle)[int(0.9 * len(idle))] * 1e3,
        "serving_step_ms_p90": sorted(serving)[int(0.9 * len(serving))] * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GB (1e9 bytes)")
    parser.add_argument("--parallel", type=int, default=4, help="fetch threads")
    parser.add_argument("--stall-steps", type=int, default=40, help="training steps per phase")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    token = secrets.token_urlsafe(24)
    shm = Path(tempfile.mkdtemp(prefix="fthsdp-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="fthsdp-bench-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        state = make_state(int(args.size_gb * 1e9))
        total = sum(t.numel() * t.element_size() for t in state.values())
        urls = []
        for i in range(3):
            proc, url = start_sidecar(shm / f"s{i}", work / f"d{i}", token)
            procs.append(proc)
            urls.append(url)
        publish_s = []
        for i, url in enumerate(urls):
            pub = SnapshotPublisher(
                url, token, job=JOB, replica_id=f"r{i}", rank=0, shm_dir=shm / f"s{i}"
            )
            start = time.perf_counter()
            pub.publish(STEP, state, {"bench": 1})
            publish_s.append(time.perf_counter() - start)
            assert list_snapshots(url, token, job=JOB, replica=f"r{i}", rank=0) == [STEP]
        snap_file = next((shm / "s0").iterdir())
        raw_into = torch.zeros(snap_file.stat().st_size, dtype=torch.uint8)
        raw_s = raw_tcp_copy(snap_file, raw_into, work)
        raw_bytes = raw_into.numel()
        del raw_into
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        sources = [Source(u, f"r{i}") for i, u in enumerate(urls)]
        one_s, one = timed_fetch(sources[:1], token, into, args.parallel)
        three_s, three = timed_fetch(sources, token, into, args.parallel)
        assert all(torch.equal(into[k], v) for k, v in state.items()), "fetched state differs"
        stalls = stall(urls[0], token, args.stall_steps)
        raw_gbps = raw_bytes / raw_s / 1e9
        rows: list[tuple[str, float, str]] = [
            ("raw TCP loopback copy", raw_gbps, "1.00"),
            ("fetch, 1 source", total / one_s / 1e9, f"{total / one_s / 1e9 / raw_gbps:.2f}"),
            (
                "fetch, 3 sources striped",
                total / three_s / 1e9,
                f"{total / three_s / 1e9 / raw_gbps:.2f}",
            ),
        ]
        print(f"\nstate: {len(state)} tensors, {total / 1e9:.3f} GB; cpus: {os.cpu_count()}")
        print(
            f"publish (one copy into shm + register): {statistics.median(publish_s) * 1e3:.0f} ms"
        )
        print(f"{'transfer':<28}{'GB/s':>8}{'vs raw':>8}")
        for name, gbps, ratio in rows:
            print(f"{name:<28}{gbps:>8.2f}{ratio:>8}")
        print(
            f"\nsource training step: idle {stalls['idle_step_ms_median']:.2f} ms median "
            f"(p90 {stalls['idle_step_ms_p90']:.2f}), "
            f"serving {stalls['serving_step_ms_median']:.2f} ms median "
            f"(p90 {stalls['serving_step_ms_p90']:.2f}), "
            f"ratio {stalls['serving_step_ms_median'] / stalls['idle_step_ms_median']:.2f}"
        )
        result: dict[str, Any] = {
            "size_bytes": total,
            "tensors": len(state),
            "cpus": os.cpu_count(),
            "parallel": args.parallel,
            "publish_ms_median": statistics.median(publish_s) * 1e3,
            "raw_tcp_gbps": raw_gbps,
            "fetch_1_source_gbps": total / one_s / 1e9,
            "fetch_3_sources_gbps": total / three_s / 1e9,
            "ratio_1_source": total / one_s / 1e9 / raw_gbps,
            "ratio_3_sources": total / three_s / 1e9 / raw_gbps,
            "bytes_per_source_3": [s.bytes for s in three.sources],
            "bytes_1_source": one.bytes_fetched,
            **stalls,
        }
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
