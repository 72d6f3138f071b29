"""One rank of ``bench.ftar``: FTAR and gloo all_reduce timed side by side on the same tensors.

Each (size, dtype) alternates FTAR and gloo every iteration, a barrier before each, so that
machine noise hits both alike. Per iteration the slowest rank's wall time counts and the CPU
time of every rank is summed (``os.times``: user and system, all threads of the process), so
CPU-seconds per GB is what the whole machine paid per GB of tensor allreduced.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # typed; dist re-exports them

from fthsdp.worker.ftar import FtarConfig, FtarRing, RecoverableFtarError

__all__ = ["DTYPES", "worker"]

MB = 1 << 20
LOSS_MB = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_cpu(fn: Any) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, system CPU seconds) of this process, all threads.

    The CPU total is precise (``process_time``); the system share comes from ``os.times``,
    which counts clock ticks (10 ms), so it is only meaningful summed over ranks and sizes.
    """
    a, c0, t0 = os.times(), time.process_time(), time.perf_counter()
    fn()
    wall, cpu, b = time.perf_counter() - t0, time.process_time() - c0, os.times()
    return wall, cpu, b.system - a.system


def _gather(values: list[float], n: int) -> torch.Tensor:
    """Every rank's ``values`` as an (n, len) tensor (no pickle: a tensor all_gather)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine)
    return torch.stack(out)


def _summary(name: str, samples: list[tuple[float, float, float]], n: int) -> dict[str, Any]:
    table = _gather([v for s in samples for v in s], n).view(n, len(samples), 3)
    wall = table[:, :, 0].max(dim=0).values.tolist()  # the slowest rank per iteration
    cpu = table[:, :, 1].sum(dim=0).tolist()  # every rank's CPU per iteration
    system = table[:, :, 2].sum(dim=0).tolist()
    return {
        f"{name}_s": statistics.median(wall),
        f"{name}_all_s": wall,
        f"{name}_cpu_s": statistics.median(cpu),
        f"{name}_sys_share": sum(system) / max(sum(cpu), 1e-9),
    }


def _measure(
    ring: FtarRing, n: int, size_mb: int, dtype: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One table row: this ring (one wire compression) against gloo on one size and dtype."""
    kind = DTYPES[dtype]
    nbytes = size_mb * MB
    x = torch.randn(nbytes // kind.itemsize).to(kind)
    y = x.clone()

    def ftar() -> None:
        ring.allreduce([x], num_contributors=n).wait()

    def gloo() -> None:
        dist.all_reduce(y)

    ftar_t, gloo_t = [], []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        a = _timed_cpu(ftar)
        dist.barrier()
        b = _timed_cpu(gloo)
        y.div_(n)  # keep magnitudes bounded across iterations, as FTAR's average does
        if i >= args.warmup:
            ftar_t.append(a)
            gloo_t.append(b)
    row: dict[str, Any] = {
        "ranks": n,
        "size_mb": size_mb,
        "dtype": dtype,
        "wire_compression": ring.config.wire_compression,
    }
    row.update(_summary("ftar", ftar_t, n))
    row.update(_summary("gloo", gloo_t, n))
    bus = 2 * (n - 1) / n
    gb = nbytes / 1e9
    for name in ("ftar", "gloo"):
        row[f"{name}_busbw_gbs"] = bus * gb / row[f"{name}_s"]
        row[f"{name}_algbw_gbs"] = gb / row[f"{name}_s"]
        row[f"{name}_cpu_s_per_gb"] = row[f"{name}_cpu_s"] / gb
    row["ratio"] = row["gloo_s"] / row["ftar_s"]
    return row


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
    """Run one rank; rank 0 prints ``RESULT <json>``. Exits the process (skips gloo teardown)."""
    torch.set_num_threads(args.threads)
    n, rank = args.world, args.rank
    # On loopback the launcher hosts the store; across hosts rank 0 does (--store-master).
    store = TCPStore(
        args.store_host,
        args.store_port,
        is_master=args.store_master,
        wait_for_workers=False,
        timeout=timedelta(seconds=120),
    )
    rings = {}  # one ring per wire compression, all measured in this run
    for comp in args.wire_compression.split(","):
        cfg = FtarConfig(
            bind_host=args.bind_host,
            chunk_bytes=args.chunk_bytes,
            chunks_in_flight=args.chunks_in_flight,
            socket_buffer_bytes=args.socket_buffer_bytes,
            chunk_timeout=timedelta(seconds=30),
            exchange_timeout=timedelta(seconds=120),
            wire_compression=comp,
        )
        rings[comp] = FtarRing(cfg)
        store.set(f"ftar/{comp}/{rank}", rings[comp].address)
    dist.init_process_group("gloo", store=PrefixStore("gloo", store), rank=rank, world_size=n)
    peers = {}  # read now: a store hosted by rank 0 is gone once rank 0 has printed
    for comp, ring in rings.items():
        peers[comp] = [store.get(f"ftar/{comp}/{i}").decode() for i in range(n)]
        ring.reconfigure(peers[comp], rank, 1)
    rows = [
        _measure(ring, n, int(s), d, args)
        for d in args.dtypes.split(",")
        for ring in rings.values()
        for s in args.sizes_mb.split(",")
    ]
    first = next(iter(rings))
    loss = None if args.no_peer_loss else _peer_loss(rings[first], peers[first], rank, n)
    if rank == 0:
        print("RESULT " + json.dumps({"rows": rows, "peer_loss": loss}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the gloo group has a dead member now: skip its teardown
