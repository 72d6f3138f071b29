"""FTAR vs torch.distributed gloo all_reduce on loopback, side by side in one run.

    python -m bench.ftar --ranks 2,4 --sizes-mb 16,64,256 --iters 5 --json bench-ftar.json

For each ring size it starts that many real processes (one rank each) around a TCPStore hosted by
this launcher; they form an FTAR ring and a gloo process group over the same store, and time both
on the same float32 tensors, alternating FTAR and gloo each iteration (a barrier before each) so
that machine noise hits both alike. Per iteration the slowest rank's time counts; the table shows
medians. Algorithm bandwidth = bytes / time; bus bandwidth = 2(n-1)/n x bytes / time (what a ring
moves per link; the number to compare with NCCL/gloo). Then the last rank SIGKILLs itself while
the others start an exchange: rank 0 reports the time to detect the loss, to reconfigure the
survivors with a new epoch, and the first and a steady exchange after it. Not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # typed; dist re-exports them

from fthsdp.worker.ftar import FtarConfig, FtarRing, RecoverableFtarError

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20
LOSS_MB = 16


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma-separated ring sizes")
    p.add_argument("--sizes-mb", default="16,64,256", help="comma-separated tensor sizes (MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per size and method")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per size first")
    p.add_argument("--chunk-bytes", type=int, default=FtarConfig().chunk_bytes)
    p.add_argument("--chunks-in-flight", type=int, default=FtarConfig().chunks_in_flight)
    p.add_argument("--socket-buffer-bytes", type=int, default=0, help="0: kernel autotuning")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--no-peer-loss", action="store_true", help="skip the peer-loss phase")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--timeout-s", type=float, default=900, help="per ring size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------- worker (one rank)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_cpu(fn: Any) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


def _measure(ring: FtarRing, n: int, size_mb: int, args: argparse.Namespace) -> dict[str, Any]:
    numel = size_mb * MB // 4
    x = torch.randn(numel)
    y = x.clone()

    def ftar() -> None:
        ring.allreduce([x], num_contributors=n).wait()

    def gloo() -> None:
        dist.all_reduce(y)

    ftar_t, gloo_t, ftar_c, gloo_c = [], [], [], []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        a, ac = _timed_cpu(ftar)
        dist.barrier()
        b, bc = _timed_cpu(gloo)
        y.div_(n)  # keep magnitudes bounded across iterations, as FTAR's average does
        if i >= args.warmup:
            ftar_t.append(a)
            gloo_t.append(b)
            ftar_c.append(ac)
            gloo_c.append(bc)
    ftar_t, gloo_t = _slowest(ftar_t), _slowest(gloo_t)
    ftar_c, gloo_c = _slowest(ftar_c), _slowest(gloo_c)
    nbytes = numel * 4
    f, g = statistics.median(ftar_t), statistics.median(gloo_t)
    bus = 2 * (n - 1) / n
    return {
        "ranks": n,
        "size_mb": size_mb,
        "ftar_s": f,
        "gloo_s": g,
        "ftar_algbw_gbs": nbytes / f / 1e9,
        "gloo_algbw_gbs": nbytes / g / 1e9,
        "ftar_busbw_gbs": bus * nbytes / f / 1e9,
        "gloo_busbw_gbs": bus * nbytes / g / 1e9,
        "ratio": g / f,
        "ftar_cpu_s": statistics.median(ftar_c),
        "gloo_cpu_s": statistics.median(gloo_c),
        "ftar_all_s": ftar_t,
        "gloo_all_s": gloo_t,
    }


def _peer_loss(ring: FtarRing, peers: list[str], rank: int, n: int) -> dict[str, Any] | None:
    x = torch.randn(LOSS_MB * MB // 4)
    dist.barrier()
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        ring.allreduce([x], num_contributors=n).wait()
        detected = None
    except RecoverableFtarError as exc:
        detected = (time.perf_counter() - t0, type(exc).__name__)
    survivors = peers[:-1]
    reconf = _timed(lambda: ring.reconfigure(survivors, rank, 2))
    m = len(survivors)
    first = _timed(lambda: ring.allreduce([x], num_contributors=m).wait())
    steady = _timed(lambda: ring.allreduce([x], num_contributors=m).wait())
    return {
        "ranks_before": n,
        "size_mb": LOSS_MB,
        "detect_s": detected[0] if detected else None,
        "detect_error": detected[1] if detected else "none (exchange completed)",
        "reconfigure_s": reconf,
        "first_exchange_s": first,
        "steady_exchange_s": steady,
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    n, rank = args.world, args.rank
    store = TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=120))
    cfg = FtarConfig(
        chunk_bytes=args.chunk_bytes,
        chunks_in_flight=args.chunks_in_flight,
        socket_buffer_bytes=args.socket_buffer_bytes,
        chunk_timeout=timedelta(seconds=30),
        exchange_timeout=timedelta(seconds=120),
    )
    ring = FtarRing(cfg)
    store.set(f"ftar/{rank}", ring.address)
    peers = [store.get(f"ftar/{i}").decode() for i in range(n)]
    dist.init_process_group("gloo", store=PrefixStore("gloo", store), rank=rank, world_size=n)
    ring.reconfigure(peers, rank, 1)
    rows = [_measure(ring, n, int(s), args) for s in args.sizes_mb.split(",")]
    loss = None if args.no_peer_loss else _peer_loss(ring, peers, rank, n)
    if rank == 0:
        print("RESULT " + json.dumps({"rows": rows, "peer_loss": loss}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the gloo group has a dead member now: skip its teardown


# ---------------------------------------------------------------- launcher


def _abort_latency(trials: int = 20) -> dict[str, float]:
    """abort() -> the stuck work's wait() raises, with 2 in-process rings (one never joins)."""
    cfg = FtarConfig(chunk_bytes=64 * 1024)
    a, b = FtarRing(cfg), FtarRing(cfg)
    samples = []
    try:
        for epoch in range(1, trials + 1):
            peers = [a.address, b.address]
            t = threading.Thread(target=b.reconfigure, args=(peers, 1, epoch))
            t.start()
            a.reconfigure(peers, 0, epoch)
            t.join()
            work = a.allreduce([torch.ones(1 << 16)], num_contributors=2)
            t0 = time.perf_counter()
            a.abort("bench")
            with contextlib.suppress(RecoverableFtarError):
                work.wait(timeout=10)
            samples.append(time.perf_counter() - t0)
            b.abort("bench")
    finally:
        a.close()
        b.close()
    return {"median_ms": statistics.median(samples) * 1e3, "max_ms": max(samples) * 1e3}


def _run_ring(n: int, args: argparse.Namespace) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv = [
        sys.executable,
        "-m",
        "fthsdp.bench.ftar",
        "--worker",
        "--world",
        str(n),
        "--store-port",
        str(store.port),
        "--sizes-mb",
        args.sizes_mb,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--chunk-bytes",
        str(args.chunk_bytes),
        "--chunks-in-flight",
        str(args.chunks_in_flight),
        "--socket-buffer-bytes",
        str(args.socket_buffer_bytes),
        "--threads",
        str(args.threads),
    ]
    if args.no_peer_loss:
        argv.append("--no-peer-loss")
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout_s)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise SystemExit(f"rank 0 of the {n}-rank run printed no result (exit {procs[0].returncode})")


def _table(rows: list[dict[str, Any]], losses: list[dict[str, Any]]) -> str:
    head = (
        f"{'ranks':>5} {'MiB':>5} | {'FTAR s':>7} {'algbw':>6} {'busbw':>6} | "
        f"{'gloo s':>7} {'algbw':>6} {'busbw':>6} | {'FTAR/gloo':>9} | CPU s FTAR/gloo"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['ranks']:>5} {r['size_mb']:>5} | {r['ftar_s']:>7.3f} {r['ftar_algbw_gbs']:>6.2f} "
            f"{r['ftar_busbw_gbs']:>6.2f} | {r['gloo_s']:>7.3f} {r['gloo_algbw_gbs']:>6.2f} "
            f"{r['gloo_busbw_gbs']:>6.2f} | {r['ratio']:>8.2f}x | "
            f"{r['ftar_cpu_s']:>7.3f}/{r['gloo_cpu_s']:.3f}"
        )
    lines.append(
        "(bandwidths in GB/s, medians of the slowest rank per iteration; CPU s = process CPU time"
        " of the busiest rank per op, all threads)"
    )
    for loss in losses:
        d = loss["detect_s"]
        lines.append(
            f"peer loss {loss['ranks_before']}->{loss['ranks_before'] - 1} ranks: detect "
            f"{'-' if d is None else f'{d * 1e3:.1f} ms'} ({loss['detect_error']}), reconfigure "
            f"{loss['reconfigure_s'] * 1e3:.1f} ms, first exchange "
            f"{loss['first_exchange_s'] * 1e3:.1f} ms, steady "
            f"{loss['steady_exchange_s'] * 1e3:.1f} ms ({loss['size_mb']} MiB)"
        )
    return "\n".join(lines)


def main() -> None:
    args = _parse()
    if args.worker:
        worker(args)
        return
    rows: list[dict[str, Any]] = []
    losses: list[dict[str, Any]] = []
    for n in (int(v) for v in args.ranks.split(",")):
        result = _run_ring(n, args)
        rows.extend(result["rows"])
        if result["peer_loss"]:
            losses.append(result["peer_loss"])
    aborts = _abort_latency()
    print(_table(rows, losses))
    print(
        f"abort() -> wait() raises: median {aborts['median_ms']:.2f} ms, "
        f"max {aborts['max_ms']:.2f} ms (target 100 ms)"
    )
    print(
        f"chunk_bytes={args.chunk_bytes} chunks_in_flight={args.chunks_in_flight} "
        f"socket_buffer_bytes={args.socket_buffer_bytes} threads={args.threads}"
    )
    if args.json:
        config = {
            k: getattr(args, k)
            for k in ("chunk_bytes", "chunks_in_flight", "socket_buffer_bytes", "threads", "iters")
        }
        args.json.write_text(
            json.dumps(
                {"config": config, "rows": rows, "peer_loss": losses, "abort": aborts}, indent=2
            )
        )


if __name__ == "__main__":
    main()
