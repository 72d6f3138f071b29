"""Peer state fetch over loopback vs raw TCP copies of the same bytes, publish time, source stall.

    python -m bench.checkpoint --size-gb 1.0 --repeats 5 --json bench-checkpoint.json

Starts three real sidecar processes and publishes one state of mixed tensor sizes to each (as
three replicas). Publish: the first one's publisher publishes `--publish-steps` steps, each timed
after the sidecar finished the last one's checksums; the first two create fresh shm segments
(retention keeps one step), the rest overwrite segments the sidecar handed back.

Transfers, interleaved in each of `--repeats` rounds, the ratios taken per round (medians shown):
`fetch_snapshot` from 1 source and striped over 3 (`--parallel` connections, into preallocated
tensors, every chunk CRC-checked), and for each the raw-TCP references with the same connections
and sources: sender processes (as niced as the sidecars) answering each connection's range with
`sendall` from the mapped file (a user-space copy: the issue's "raw TCP copy") or `sendfile` (the
kernel-only ceiling), received with `recv_into` into one buffer; plus the single-stream copy that
earlier runs compared against. CPU-seconds per GB count the receiving process (the bench) and the
serving processes over each transfer; "of it CRC" is the fetch threads' time in the end-to-end
checksum (`FetchedSnapshot.checksum_seconds`), the one pass a raw copy does not make.

Last, the source's "training step" (a fixed matmul loop in this process) idle vs while a fetcher
process pulls its snapshot. Prints a table and writes JSON (not a pass/fail test)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from fthsdp.bench.checkpoint_raw import CpuMeter, RawSenders, Sample
from fthsdp.services.checkpoint.client import (
    SnapshotPublisher,
    Source,
    fetch_snapshot,
    list_snapshots,
)
from fthsdp.services.checkpoint.client_http import call_json
from fthsdp.services.common.tokens import Token

JOB = "bench"
STEP_BASE = 1
ROOT = Path(__file__).resolve().parents[1]

FETCHER = r"""
import os, sys, time
os.nice(19)  # the fetcher stands for a remote host: it must not steal the source's CPU here
from datetime import timedelta
from fthsdp.services.checkpoint.client import Source, fetch_snapshot
url, token, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("started", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    fetch_snapshot([Source(url, "r0")], job="bench", rank=0, step=int(sys.argv[4]), token=token,
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


def start_sidecar(
    shm: Path, durable: Path, token: str, nice: int, send_with: str = "write"
) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, FTHSDP_TOKEN=token, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "fthsdp.services.checkpoint", "--port", "0", "--shm-dir", str(shm)]
    cmd += ["--durable-dir", str(durable), "--retain-snapshots", "1", "--nice", str(nice)]
    cmd += ["--send-with", send_with]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"sidecar failed to start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def step_times(steps: int) -> list[float]:
    a = torch.rand(384, 384)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a)
        out.append(time.perf_counter() - start)
    return out


def stall(url: str, token: str, steps: int, step: int) -> dict[str, float]:
    idle = step_times(steps)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    fetcher = subprocess.Popen(
        [sys.executable, "-c", FETCHER, url, token, "600", str(step)],
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


def publish_times(
    url: str, token: str, shm: Path, state: dict[str, torch.Tensor], steps: int
) -> list[tuple[float, bool]]:
    """(seconds, reused) of each publish of steps STEP_BASE.. on one sidecar, each started once
    the sidecar has the last one's checksums (their CPU is not the publisher's)."""
    pub = SnapshotPublisher(url, token, job=JOB, replica_id="r0", rank=0, shm_dir=shm)
    out = []
    for step in range(STEP_BASE, STEP_BASE + steps):
        reused = pub.reused
        start = time.perf_counter()
        pub.publish(step, state, {"bench": 1})
        out.append((time.perf_counter() - start, pub.reused > reused))
        path = f"/v1/snapshots/{JOB}/r0/0/{step}/manifest"
        call_json(url, Token(token), "GET", path, timeout=timedelta(minutes=2))
    return out


def snapshot_file(shm: Path, replica: str, step: int) -> Path:
    (path,) = shm.glob(f"fthsdp-{JOB}-{replica}-r0-s{step}-*.snap")
    return path


Row = tuple[str, int, int, Callable[[], float], list[int]]
"""(name, connections, sources, transfer (returns its seconds checksumming), serving pids)."""


def measure(rows: list[Row], repeats: int) -> dict[str, list[Sample]]:
    """`repeats` timed rounds of every row, after one untimed round: each transfer's first run
    faults in its sender's mapping and opens its connections, which no later round repeats."""
    for _, _, _, transfer, _ in rows:
        transfer()
    samples: dict[str, list[Sample]] = {name: [] for name, *_ in rows}
    for _ in range(repeats):
        for name, _, _, transfer, pids in rows:
            samples[name].append(CpuMeter(pids).run(transfer))
    return samples


def summarize(
    rows: list[Row], samples: dict[str, list[Sample]], total: int
) -> list[dict[str, Any]]:
    """Medians per row, and per-round ratios of each fetch to its raw references."""
    out = []
    for name, conns, srcs, _, _ in rows:
        got = samples[name]
        entry: dict[str, Any] = {
            "name": name,
            "connections": conns,
            "sources": srcs,
            "gbps": statistics.median(total / s.seconds / 1e9 for s in got),
            "gbps_all": [total / s.seconds / 1e9 for s in got],
            "cpu_s_per_gb": statistics.median(
                (s.client_cpu + s.server_cpu) / total * 1e9 for s in got
            ),
            "client_cpu_s_per_gb": statistics.median(s.client_cpu / total * 1e9 for s in got),
            "server_cpu_s_per_gb": statistics.median(s.server_cpu / total * 1e9 for s in got),
            "checksum_s_per_gb": statistics.median(s.checksum_s / total * 1e9 for s in got),
        }
        if name.startswith("fetch"):
            for mode in ("sendall", "sendfile"):
                ref = samples[f"raw {mode}, {conns} conn, {srcs} src"]
                ratios = [r.seconds / f.seconds for f, r in zip(got, ref, strict=True)]
                entry[f"ratio_vs_raw_{mode}"] = statistics.median(ratios)
                entry[f"ratios_vs_raw_{mode}"] = ratios
        out.append(entry)
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    print(
        f"{'transfer':<30}{'conns':>6}{'srcs':>5}{'GB/s':>7}{'CPU-s/GB':>10}"
        f"{'(client+server)':>17}{'of it CRC':>10}{'vs sendall':>12}{'vs sendfile':>12}"
    )
    for e in summary:
        split = f"{e['client_cpu_s_per_gb']:.2f}+{e['server_cpu_s_per_gb']:.2f}"
        crc = f"{e['checksum_s_per_gb']:.3f}" if e["checksum_s_per_gb"] else ""
        ratios = "".join(
            f"{e[k]:>12.2f}" if k in e else f"{'':>12}"
            for k in ("ratio_vs_raw_sendall", "ratio_vs_raw_sendfile")
        )
        print(
            f"{e['name']:<30}{e['connections']:>6}{e['sources']:>5}{e['gbps']:>7.2f}"
            f"{e['cpu_s_per_gb']:>10.2f}{split:>17}{crc:>10}{ratios}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GB (1e9 bytes)")
    parser.add_argument("--parallel", type=int, default=4, help="fetch connections (threads)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every transfer")
    parser.add_argument("--publish-steps", type=int, default=5, help="publishes timed (≥ 3)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of sidecars and senders")
    parser.add_argument(
        "--send-with", choices=("write", "sendfile"), default="write", help="sidecars' mode"
    )
    parser.add_argument("--stall-steps", type=int, default=40, help="training steps per phase")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    token = secrets.token_urlsafe(24)
    shm = Path(tempfile.mkdtemp(prefix="fthsdp-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="fthsdp-bench-"))
    procs: list[subprocess.Popen[str]] = []
    senders: list[RawSenders] = []
    try:
        state = make_state(int(args.size_gb * 1e9))
        total = sum(t.numel() * t.element_size() for t in state.values())
        urls = []
        for i in range(3):
            proc, url = start_sidecar(
                shm / f"s{i}", work / f"d{i}", token, args.nice, args.send_with
            )
            procs.append(proc)
            urls.append(url)
        publishes = publish_times(urls[0], token, shm / "s0", state, args.publish_steps)
        step = STEP_BASE + args.publish_steps - 1
        for i in (1, 2):
            pub = SnapshotPublisher(
                urls[i], token, job=JOB, replica_id=f"r{i}", rank=0, shm_dir=shm / f"s{i}"
            )
            start = time.perf_counter()
            pub.publish(step, state, {"bench": 1})
            publishes.append((time.perf_counter() - start, False))
        for i, url in enumerate(urls):
            assert list_snapshots(url, token, job=JOB, replica=f"r{i}", rank=0) == [step]
        files = [snapshot_file(shm / f"s{i}", f"r{i}", step) for i in range(3)]
        senders = [RawSenders(files, mode, args.nice) for mode in ("sendall", "sendfile")]
        buffer = torch.empty(files[0].stat().st_size, dtype=torch.uint8)
        view = memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        sources = [Source(u, f"r{i}") for i, u in enumerate(urls)]

        def fetch(n: int) -> Callable[[], float]:
            def run() -> float:
                return fetch_snapshot(
                    sources[:n], job=JOB, rank=0, step=step, token=token, into=into,
                    deadline=timedelta(minutes=5), parallel=args.parallel,
                ).checksum_seconds  # fmt: skip

            return run

        def raw(sender: RawSenders, n: int, conns: int) -> Callable[[], float]:
            def run() -> float:
                sender.copy(view, n, conns)
                return 0.0

            return run

        rows: list[Row] = []
        for n in (1, 3):
            pids = [p.pid for p in procs[:n]]
            rows.append((f"fetch, {n} source(s)", args.parallel, n, fetch(n), pids))
            for sender in senders:
                name = f"raw {sender.mode}, {args.parallel} conn, {n} src"
                rows.append(
                    (name, args.parallel, n, raw(sender, n, args.parallel), sender.pids[:n])
                )
        rows.append(
            ("raw sendall, 1 conn, 1 src", 1, 1, raw(senders[0], 1, 1), senders[0].pids[:1])
        )
        samples = measure(rows, args.repeats)
        assert all(torch.equal(into[k], v) for k, v in state.items()), "fetched state differs"
        summary = summarize(rows, samples, total)
        for sender in senders:
            sender.close()
        senders = []
        stalls = stall(urls[0], token, args.stall_steps, step) if args.stall_steps else {}
        fresh = [s for s, reused in publishes if not reused]
        reused = [s for s, r in publishes if r]
        load = os.getloadavg()
        print(
            f"\nstate: {len(state)} tensors, {total / 1e9:.3f} GB; cpus: {os.cpu_count()}; "
            f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.repeats} rounds; "
            f"sidecars send with {args.send_with}"
        )
        print(
            f"publish {total / 1e9:.2f} GB (copy into shm + register): fresh segment "
            f"{statistics.median(fresh) * 1e3:.0f} ms median of {len(fresh)}, reused segment "
            + (
                f"{statistics.median(reused) * 1e3:.0f} ms median of {len(reused)}"
                if reused
                else "n/a"
            )
        )
        print_table(summary)
        if stalls:
            print(
                f"\nsource training step: idle {stalls['idle_step_ms_median']:.2f} ms median "
                f"(p90 {stalls['idle_step_ms_p90']:.2f}), "
                f"serving {stalls['serving_step_ms_median']:.2f} ms median "
                f"(p90 {stalls['serving_step_ms_p90']:.2f}), ratio "
                f"{stalls['serving_step_ms_median'] / stalls['idle_step_ms_median']:.2f}"
            )
        result: dict[str, Any] = {
            "size_bytes": total,
            "tensors": len(state),
            "cpus": os.cpu_count(),
            "load_average": load,
            "parallel": args.parallel,
            "repeats": args.repeats,
            "nice": args.nice,
            "send_with": args.send_with,
            "publish_fresh_ms": [s * 1e3 for s in fresh],
            "publish_reused_ms": [s * 1e3 for s in reused],
            "publish_fresh_ms_median": statistics.median(fresh) * 1e3,
            "publish_reused_ms_median": statistics.median(reused) * 1e3 if reused else None,
            "transfers": summary,
            **stalls,
        }
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    finally:
        for sender in senders:
            sender.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
