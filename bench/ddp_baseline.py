"""Plain torch DDP over gloo on the demo's model and data: the baseline of `bench.recovery`'s
fault-free overhead.

    python -m bench.ddp_baseline --rank 0 --world-size 6 --replicas 3 --ranks 2 \
        --init-method tcp://127.0.0.1:29500 --out rank0.json

One process per rank, all R×W ranks in one gloo process group (no replicas, no quorum, no
checkpoints). Everything else mirrors `deploy.demo.train`: TinyGPT with the same config and seed,
AdamW at the same learning rate, one intra-op thread, and the same exactly-once sampling: global
rank g trains the micro-batch that rank g % W of replica g // W would train at the same step, so
the average gradient of a DDP step equals the one of a fault-free fthsdp step (and the losses
agree up to float summation order). `run_ddp` starts the ranks and collects their timings."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True, help="global rank, 0..world-size-1")
    p.add_argument("--world-size", type=int, required=True, help="replicas × ranks")
    p.add_argument("--replicas", type=int, required=True, help="replicas the data is sharded by")
    p.add_argument("--ranks", type=int, required=True, help="ranks per replica")
    p.add_argument("--init-method", required=True, help="tcp://host:port rendezvous")
    p.add_argument("--steps", type=int, default=300, help="measured steps")
    p.add_argument("--warmup", type=int, default=30, help="unmeasured steps first")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init seed")
    p.add_argument("--out", type=Path, required=True, help="JSON file for this rank's timings")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.world_size != args.replicas * args.ranks:
        raise ValueError("world-size must equal replicas × ranks")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fthsdp.deploy.demo.corpus import CharDataset
    from fthsdp.deploy.demo.model import TinyGPTConfig, build_model
    from fthsdp.worker.data import ShardSpec

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    dataset = CharDataset()
    model = build_model(TinyGPTConfig(vocab_size=dataset.vocab_size), seed=args.seed)
    dist.init_process_group(
        "gloo", init_method=args.init_method, rank=args.rank, world_size=args.world_size
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    spec = ShardSpec(
        replica_index=args.rank // args.ranks,
        total_replicas=args.replicas,
        rank=args.rank % args.ranks,
        world_size=args.ranks,
        micro_batch=args.micro_batch,
    )
    # Every rank starts timing together, so the first measured interval is a real step.
    dist.barrier()
    ends: list[float] = []
    phases: dict[str, list[float]] = {"data": [], "forward": [], "backward": [], "optimizer": []}
    losses: list[float] = []
    last = time.perf_counter()
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        x, y = dataset.collate(
            [dataset.sample(i) for i in spec.sample_ids(step * spec.samples_per_step)]
        )
        t1 = time.perf_counter()
        _, loss = ddp(x, y)
        assert loss is not None
        t2 = time.perf_counter()
        loss.backward()  # DDP's all-reduce runs inside backward (bucket hooks)
        losses.append(float(loss.item()))
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        now = time.perf_counter()
        if step >= args.warmup:
            ends.append(now - last)
            for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, now - t3), strict=True):
                phases[name].append(value)
        last = now
    dist.barrier()
    dist.destroy_process_group()
    args.out.write_text(
        json.dumps({"rank": args.rank, "intervals": ends, "phases": phases, "losses": losses})
    )
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ddp(
    *,
    replicas: int,
    ranks: int,
    steps: int,
    warmup: int,
    micro_batch: int,
    seed: int,
    work_dir: Path,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Starts replicas × ranks DDP processes, waits for them, and returns each rank's result
    (`intervals`: seconds between consecutive step ends; `phases`; `losses`). Raises
    `RuntimeError` when a rank fails or the run outlives `timeout_s` (the ranks are killed)."""
    world = replicas * ranks
    work_dir.mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outs = [work_dir / f"rank{g}.json" for g in range(world)]
    log_path = work_dir / "ddp.log"
    procs: list[subprocess.Popen[bytes]] = []
    with log_path.open("ab") as log_file:
        for g in range(world):
            argv = [
                sys.executable, "-m", "fthsdp.bench.ddp_baseline",
                "--rank", str(g), "--world-size", str(world),
                "--replicas", str(replicas), "--ranks", str(ranks),
                "--init-method", init, "--steps", str(steps), "--warmup", str(warmup),
                "--micro-batch", str(micro_batch), "--seed", str(seed), "--out", str(outs[g]),
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=log_file)
            )
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"DDP baseline timed out after {timeout_s:.0f} s; see {log_path}"
        ) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        raise RuntimeError(f"DDP baseline ranks exited with {codes}; see {log_path}")
    return [json.loads(out.read_text()) for out in outs]


if __name__ == "__main__":
    sys.exit(main())
