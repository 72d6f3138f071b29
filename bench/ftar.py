"""FTAR vs torch.distributed gloo all_reduce, side by side in one run.

    python -m bench.ftar --ranks 2,4 --sizes-mb 64,256 --dtypes fp32,bf16 --iters 5 \
        --json bench-ftar.json
    python -m bench.ftar --hosts netns --rate-mbit 1000 --ranks 3,4 --sizes-mb 64,256 \
        --no-peer-loss      # root: each rank on a host of its own, 1 Gbit/s links

For each ring size it starts that many real processes (one rank each, :mod:`bench.ftar_rank`)
around a TCPStore hosted by this launcher; they form an FTAR ring and a gloo process group over
the same store, and time both on the same tensors (``--sizes-mb`` is the tensor's size in bytes,
whatever its dtype), alternating FTAR and gloo each iteration. The table shows medians: bus
bandwidth = 2(n-1)/n x bytes / time of the slowest rank (what a ring moves per link; the number
to compare with NCCL/gloo), and CPU-seconds per GB = the CPU time of all ranks together (user +
system, every thread) per GB of tensor allreduced. Then the last rank SIGKILLs itself while the
others start an exchange: rank 0 reports the time to detect the loss, to reconfigure the
survivors with a new epoch, and the first and a steady exchange after it. Not a pass/fail test.

``--hosts netns`` (root) puts each rank on a network namespace of its own, joined by a bridge,
with every host's link limited to ``--rate-mbit`` each way (:mod:`bench.ftar_hosts`); the table
then also shows that rate in GB/s, which no ring's bus bandwidth can exceed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore  # typed; dist re-exports it

from fthsdp.bench.ftar_hosts import HOSTS, link_gbs, netns_ranks, resolve_rate
from fthsdp.bench.ftar_rank import DTYPES, worker
from fthsdp.deploy.netns import MechanismMissing, NetnsUnavailable, SubnetCollision
from fthsdp.worker.ftar import FtarConfig, FtarRing, RecoverableFtarError

ROOT = Path(__file__).resolve().parents[1]
_FORWARDED = (
    "sizes_mb",
    "dtypes",
    "iters",
    "warmup",
    "chunk_bytes",
    "chunks_in_flight",
    "socket_buffer_bytes",
    "threads",
    "wire_compression",
)


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma-separated ring sizes")
    p.add_argument("--sizes-mb", default="16,64,256", help="comma-separated tensor sizes (MiB)")
    p.add_argument("--dtypes", default="fp32", help=f"comma-separated, of {','.join(DTYPES)}")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per size and method")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per size first")
    p.add_argument("--chunk-bytes", type=int, default=FtarConfig().chunk_bytes)
    p.add_argument("--chunks-in-flight", type=int, default=FtarConfig().chunks_in_flight)
    p.add_argument("--socket-buffer-bytes", type=int, default=0, help="0: kernel autotuning")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--wire-compression",
        default="none",
        help="comma-separated FtarConfig.wire_compression values, each its own FTAR row "
        "(none, bf16, fp16; the half ones are lossy and opt-in: see worker.ftar.codec)",
    )
    p.add_argument("--no-peer-loss", action="store_true", help="skip the peer-loss phase")
    p.add_argument(
        "--hosts",
        choices=HOSTS,
        default="loopback",
        help="loopback: every rank on this machine's loopback; netns (root): each rank on a "
        "network namespace of its own, on a bridge",
    )
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="--hosts netns: every rank's link limited to this each way (tbf; default "
        "1000; 0: no limit)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--timeout-s", type=float, default=900, help="per ring size")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store-host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--store-master", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind-host", default=FtarConfig().bind_host, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = set(args.dtypes.split(",")) - set(DTYPES)
    if bad:
        p.error(f"unknown dtypes {sorted(bad)}; choose from {sorted(DTYPES)}")
    if set(args.wire_compression.split(",")) - {"none", "bf16", "fp16"}:
        p.error("--wire-compression takes none, bf16, fp16")
    try:
        args.rate_mbit = resolve_rate(args.hosts, args.rate_mbit)
    except ValueError as exc:
        p.error(str(exc))
    return args


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


def _worker_argv(n: int, args: argparse.Namespace) -> list[str]:
    """A rank's command, less its rank and where it finds the store."""
    argv = [sys.executable, "-m", "fthsdp.bench.ftar", "--worker", "--world", str(n)]
    for name in _FORWARDED:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.no_peer_loss:
        argv.append("--no-peer-loss")
    return argv


def _run_ring(n: int, args: argparse.Namespace) -> dict[str, Any]:
    argv = _worker_argv(n, args)
    if args.hosts == "netns":
        with netns_ranks(argv, n, args.rate_mbit, cwd=ROOT, stdout=subprocess.PIPE, text=True) as p:
            return _collect(n, p, args.timeout_s)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv += ["--store-port", str(store.port)]
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    return _collect(n, procs, args.timeout_s)


def _collect(n: int, procs: list[subprocess.Popen[str]], timeout_s: float) -> dict[str, Any]:
    """Rank 0's result; every rank is ended on the way out."""
    try:
        out, _ = procs[0].communicate(timeout=timeout_s)
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


def _table(
    rows: list[dict[str, Any]], losses: list[dict[str, Any]], link: float | None = None
) -> str:
    """``link``: the hosts' link rate in GB/s, a column of its own (busbw then to 3 decimals:
    a 1 Gbit/s link is 0.125 GB/s)."""
    bw = 3 if link else 2
    head = (
        f"{'ranks':>5} {'MiB':>4} {'dtype':>5} {'wire':>4} | {'FTAR busbw':>10} {'CPU-s/GB':>8} | "
        f"{'gloo busbw':>10} {'CPU-s/GB':>8} | {'FTAR/gloo':>9} {'CPU ratio':>9}"
    ) + (f" | {'link GB/s':>9}" if link else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['ranks']:>5} {r['size_mb']:>4} {r['dtype']:>5} {r['wire_compression']:>4} | "
            f"{r['ftar_busbw_gbs']:>10.{bw}f} {r['ftar_cpu_s_per_gb']:>8.3f} | "
            f"{r['gloo_busbw_gbs']:>10.{bw}f} {r['gloo_cpu_s_per_gb']:>8.3f} | "
            f"{r['ratio']:>8.2f}x {r['ftar_cpu_s'] / r['gloo_cpu_s']:>8.2f}x"
            + (f" | {link:>9.3f}" if link else "")
        )
    lines.append(
        "(busbw in GB/s: medians over iterations of the slowest rank; CPU-s/GB: median CPU time"
        " of all ranks together, user + system, per GB of tensor; CPU ratio: FTAR/gloo; wire:"
        " FTAR's wire compression, none = exact"
        + ("; link: every host's link rate limit each way, the ceiling of busbw)" if link else ")")
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


def _hosts_line(rate_mbit: float) -> str:
    """What ``--hosts netns`` measured across: the table's first line."""
    limit = f"{rate_mbit:g} Mbit/s each way" if rate_mbit else "none"
    return f"hosts: netns, one network namespace per rank on a bridge; link rate limit: {limit}"


def _run_rings(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every ring size's rows and peer losses. Namespaces that cannot be made here end the run
    with their reason on one line (a user's error, not a traceback)."""
    rows: list[dict[str, Any]] = []
    losses: list[dict[str, Any]] = []
    try:
        for n in (int(v) for v in args.ranks.split(",")):
            result = _run_ring(n, args)
            rows.extend(result["rows"])
            if result["peer_loss"]:
                losses.append(result["peer_loss"])
    except (NetnsUnavailable, MechanismMissing, SubnetCollision) as exc:
        raise SystemExit(f"--hosts netns: {exc}") from None
    return rows, losses


def main() -> None:
    args = _parse()
    if args.worker:
        worker(args)
        return
    rows, losses = _run_rings(args)
    aborts = _abort_latency()
    link = link_gbs(args.rate_mbit)
    if args.hosts == "netns":
        print(_hosts_line(args.rate_mbit))
    print(_table(rows, losses, link))
    print(
        f"abort() -> wait() raises: median {aborts['median_ms']:.2f} ms, "
        f"max {aborts['max_ms']:.2f} ms (target 100 ms)"
    )
    print(
        f"chunk_bytes={args.chunk_bytes} chunks_in_flight={args.chunks_in_flight} "
        f"socket_buffer_bytes={args.socket_buffer_bytes} threads={args.threads} "
        f"wire_compression={args.wire_compression}"
    )
    if args.json:
        config = {k: getattr(args, k) for k in ("ranks", *_FORWARDED)}
        if args.hosts == "netns":  # loopback's files stay as they were
            config.update(hosts=args.hosts, rate_mbit=args.rate_mbit, link_gbs=link)
        args.json.write_text(
            json.dumps(
                {"config": config, "rows": rows, "peer_loss": losses, "abort": aborts}, indent=2
            )
        )


if __name__ == "__main__":
    main()
