"""One rank of the demo job: a tiny GPT trained with the fthsdp Manager.

Started by the local launcher (one process per rank, `python -m fthsdp.deploy.demo.train ...`); it
can equally run under torchrun (one torchrun job per replica) since it reads RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT when the flags are absent. The replica leader appends JSON lines to
`<run-dir>/replicas/<replica>.jsonl` (the format `deploy.demo.report` reads)."""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # A rank's start is mostly imports (torch, and the compiler stack its optimizers pull in)
    # that allocate millions of objects: without collections in between it costs about 30 %
    # less CPU (1.3 s per rank here, paid again at every restart). `main` turns collection back
    # on after the warm-up, with everything allocated so far frozen out of it.
    gc.disable()

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch

from fthsdp.deploy.demo import ballast
from fthsdp.deploy.demo.corpus import CharWindows, demo_dataset
from fthsdp.deploy.demo.events import CommitEvent, EventLog, FinalEvent, StartEvent
from fthsdp.deploy.demo.mixes import MAX_STATE_PAD_MB, SEQ_LEN_MIXES
from fthsdp.deploy.demo.model import TinyGPTConfig, build_model
from fthsdp.services.common.cli import add_logging_flags, setup_logging
from fthsdp.services.common.private_dir import default_shm_dir
from fthsdp.services.common.tokens import load_token
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.faults import FaultPlan
from fthsdp.worker.ftar import FtarConfig
from fthsdp.worker.manager import Manager
from fthsdp.worker.optim import OptimizerWrapper
from fthsdp.worker.replica_group import ReplicaGroup
from fthsdp.worker.rng_state import RNGState
from fthsdp.worker.sampler import ExactlyOnceDataLoader
from fthsdp.worker.spare import take_identity, warm_up
from fthsdp.worker.step import StepOutcome

log = logging.getLogger("fthsdp.demo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True, help="where the JSON-lines logs go")
    p.add_argument("--job", default="demo", help="job id (checkpoints are stored under it)")
    p.add_argument("--replica-id", help="stable id of this replica, e.g. r0 (required)")
    p.add_argument("--replica-index", type=int, help="data shard of the replica (required)")
    p.add_argument("--total-replicas", type=int, required=True, help="replicas in the job")
    p.add_argument("--rank", type=int, default=int(env.get("RANK", "0")), help="rank in replica")
    p.add_argument(
        "--world-size", type=int, default=int(env.get("WORLD_SIZE", "1")), help="ranks/replica"
    )
    default_init = (
        f"tcp://{env.get('MASTER_ADDR', '127.0.0.1')}:{env['MASTER_PORT']}"
        if "MASTER_PORT" in env
        else None
    )
    p.add_argument("--init-method", default=default_init, help="rendezvous of the replica's ranks")
    p.add_argument(
        "--quorum", required=True, help="quorum service host:port[,host:port...] (all instances)"
    )
    p.add_argument("--checkpoint-url", help="this host's checkpoint sidecar URL (required)")
    p.add_argument(
        "--shm-dir",
        default=str(default_shm_dir()),
        help="shared-memory dir of the checkpoint sidecar (default /dev/shm/fthsdp-<uid>)",
    )
    p.add_argument("--token-file", help="bearer token file (else FTHSDP_TOKEN/FTHSDP_TOKEN_FILE)")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per micro-step")
    p.add_argument(
        "--micro-steps",
        type=int,
        default=1,
        help="the replica's even share of micro-steps per step (gradient accumulation; the "
        "quorum service's fail-slow planner may move some between replicas; default 1)",
    )
    p.add_argument(
        "--max-micro-steps",
        type=int,
        default=0,
        help="the most micro-steps the planner may give this replica in a step (0: no limit)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init seed (same on every replica)")
    p.add_argument("--durable-every-steps", type=int, default=0, help="durable checkpoint period")
    p.add_argument(
        "--stop-file",
        type=Path,
        help="JSON {'stop_at_step': N} written by the launcher: train until step N, then exit",
    )
    p.add_argument("--max-steps", type=int, default=1_000_000, help="hard cap on steps")
    p.add_argument(
        "--state-pad-mb", type=int, default=0,
        help=f"MiB of constant bytes added to this rank's replicated state (0..{MAX_STATE_PAD_MB}),"
        " so snapshots and catch-up fetches move as much as a larger model's would (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--await-replicas-s", type=float, default=0.0,
        help="at the job's first launch: the leader waits up to this long for every replica "
        "to register before the first step (0: start at once)",
    )  # fmt: skip
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model over the replica's ranks with FSDP2 (HSDP); default: replicate",
    )
    p.add_argument(
        "--overlap-backward",
        action="store_true",
        help="exchange gradient buckets across replicas while backward still runs",
    )
    p.add_argument(
        "--loader-workers",
        type=int,
        default=0,
        help="DataLoader worker processes of this rank (default 0: load in the rank itself)",
    )
    p.add_argument(
        "--seq-len-mix",
        choices=SEQ_LEN_MIXES,
        default="uniform",
        help="document lengths: uniform (one 64-token window per sample, the default), phases "
        "(512-token samples packed from short, then long documents, alternating every 20 "
        "micro-batches) or random (packed from 8-512-token documents)",
    )
    p.add_argument(
        "--ftar-host",
        default="127.0.0.1",
        help="host name or IP this rank's FTAR listener binds and advertises to its peers "
        "(default 127.0.0.1; in containers and on clusters: the pod/host address)",
    )
    p.add_argument(
        "--health", default=None, help="health node agent host:port for telemetry (default: none)"
    )
    p.add_argument(
        "--control-plane-grace-ms",
        type=int,
        default=300,
        help="train on the previous quorum after the quorum service is unreachable this long "
        "(steady state only; -1: always wait)",
    )
    p.add_argument(
        "--spare",
        action="store_true",
        help="a warm spare: import and build the model, then wait for the rest of the command "
        "line (this rank's identity) from the launcher (fthsdp.worker.spare; FTHSDP_SPARE_FDS)",
    )
    add_logging_flags(p)
    args = p.parse_args(argv)
    missing = [
        flag
        for flag, value in (
            ("--replica-id", args.replica_id),
            ("--replica-index", args.replica_index),
            ("--checkpoint-url", args.checkpoint_url),
        )
        if value is None
    ]
    if missing and not args.spare:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    if not 0 <= args.state_pad_mb <= MAX_STATE_PAD_MB:
        p.error(f"--state-pad-mb must be in 0..{MAX_STATE_PAD_MB}")
    return args


def _take_identity(argv: list[str]) -> argparse.Namespace | None:
    """A spare's wait: its full arguments once the launcher hands it an identity (which also
    moves its output to the replica's log); None outside a spare."""
    identity = take_identity()
    if identity is None:
        return None
    return parse_args([a for a in argv if a != "--spare"] + list(identity.argv))


def shard_replica(model: torch.nn.Module, group: ReplicaGroup) -> None:
    """FSDP2 inside the replica: each block, then the root, sharded over the replica's ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if group.world_size == 1:
        return  # nothing to shard over
    mesh = init_device_mesh("cpu", (group.world_size,))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _stop_at(stop_file: Path | None) -> int:
    if stop_file is None:
        return -1
    try:
        return int(json.loads(stop_file.read_text())["stop_at_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    # Before the identity: what a spare does ahead of time (torch is imported already).
    dataset = demo_dataset(
        args.seq_len_mix, samples_per_round=args.total_replicas * args.world_size * args.micro_batch
    )
    model = build_model(
        TinyGPTConfig(
            vocab_size=dataset.vocab_size,
            block_size=dataset.block_size,
            doc_token=dataset.doc_token,
        ),
        seed=args.seed,
    )
    warm_up()  # before the identity and the check-in, fresh rank or spare
    gc.freeze()  # never collectable: later collections need not walk it
    gc.enable()
    if args.spare:
        taken = _take_identity(argv)
        if taken is None:
            raise SystemExit("--spare needs a launcher that keeps spares (FTHSDP_SPARE_FDS)")
        args = taken
    # Every line names the rank it came from: the replica's ranks share one log file.
    setup_logging(args, os.environ, fields={"replica_id": args.replica_id, "rank": args.rank})
    torch.manual_seed(args.seed)
    token = load_token(path=args.token_file).value
    group = ReplicaGroup.init(
        rank=args.rank,
        world_size=args.world_size,
        init_method=args.init_method or "",
        timeout=timedelta(seconds=60),
    )
    if args.state_pad_mb:
        ballast.add_ballast(model, args.state_pad_mb)
    if args.fsdp:
        shard_replica(model, group)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    events = (
        EventLog(args.run_dir / "replicas" / f"{args.replica_id}.jsonl")
        if group.is_leader
        else None
    )

    def on_commit(outcome: StepOutcome) -> None:
        if events is not None:
            events.write(
                CommitEvent(
                    replica=args.replica_id,
                    step=outcome.step,
                    quorum_id=outcome.quorum_id,
                    healthy=tuple(outcome.healthy),
                    recovered=outcome.recovered,
                    trained={r: (span[0], span[1]) for r, span in outcome.trained.items()},
                    loss=None if outcome.recovered else last_loss,
                    tokens=(
                        0
                        if outcome.recovered
                        else len(batch_ids) * args.world_size * dataset.block_size
                    ),
                    attempts=outcome.attempts,
                    seconds=dict(outcome.seconds),
                    without_control_plane=outcome.without_control_plane,
                    samples=tuple(batch_ids),
                )
            )

    samples_per_step = args.micro_batch * args.world_size
    manager = Manager(
        config=ManagerConfig(
            job_id=args.job,
            replica_id=args.replica_id,
            replica_index=args.replica_index,
            total_replicas=args.total_replicas,
            quorum_address=args.quorum,
            checkpoint_url=args.checkpoint_url,
            token=token,
            shm_dir=args.shm_dir,
            durable_every_steps=args.durable_every_steps,
            micro_steps=args.micro_steps,
            max_micro_steps=args.max_micro_steps,
            overlap_backward=args.overlap_backward,
            health_address=args.health,
            await_replicas=timedelta(seconds=args.await_replicas_s),
            control_plane_grace=(
                None
                if args.control_plane_grace_ms < 0
                else timedelta(milliseconds=args.control_plane_grace_ms)
            ),
        ),
        ftar_config=FtarConfig(bind_host=args.ftar_host),
        model=model,
        optimizer=optimizer,
        group=group,
        samples_per_step=samples_per_step,
        # Seeded alike on every replica; after a catch-up they continue like the source's.
        state={"rng": RNGState(seed=args.seed)},
        on_commit=on_commit,
        faults=FaultPlan.from_env(args.replica_id, args.rank),
    )
    optimizer = OptimizerWrapper(manager)
    loader = ExactlyOnceDataLoader(
        CharWindows(dataset),
        manager,
        args.micro_batch,
        num_workers=args.loader_workers,
        persistent_workers=args.loader_workers > 0,
    )
    batches = iter(loader)  # endless: the same samples again until a step commits with them
    if events is not None:
        events.write(StartEvent(replica=args.replica_id, step=manager.step, pid=os.getpid()))
    terminate = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal terminate
        terminate = True

    signal.signal(signal.SIGTERM, on_sigterm)
    last_loss: float | None = None
    batch_ids: list[int] = []
    stop_at = -1
    while manager.step < args.max_steps and not terminate:
        # Every rank reads the launcher's stop file before each step (an open of a missing
        # file until the end: microseconds). It is written once, atomically, with the last
        # step some way ahead, so the ranks of a replica, in lockstep, all read it in time.
        if stop_at < 0:
            stop_at = _stop_at(args.stop_file)
        if 0 <= stop_at <= manager.step:
            break
        optimizer.zero_grad()
        batch_ids = []
        tokens = sum_seq_len_sq = 0
        micro_steps = manager.micro_steps  # the fail-slow planner may move some
        for micro in range(micro_steps):
            windows, ids = next(batches)
            ids_now = [int(i) for i in ids]
            batch_ids += ids_now
            # All but the last backward only accumulate; the last one ends with the sum of
            # every micro-step's gradient averaged across the healthy replicas' micro-steps.
            last = micro == micro_steps - 1
            with contextlib.nullcontext() if last else manager.no_sync():
                _, loss = model(windows[:, :-1], windows[:, 1:])
                assert loss is not None
                loss.backward()
            last_loss = float(loss.item())
            # The real work of this micro-batch, a pure function of its sample ids.
            work = dataset.work(ids_now)
            tokens, sum_seq_len_sq = tokens + work[0], sum_seq_len_sq + work[1]
        manager.report_work(tokens=tokens, sum_seq_len_sq=sum_seq_len_sq)
        optimizer.step()
    final_fingerprint = manager.fingerprint()  # a collective over the replica's ranks
    if events is not None:
        events.write(
            FinalEvent(replica=args.replica_id, step=manager.step, fingerprint=final_fingerprint)
        )
    manager.shutdown()
    group.close()
    return 0


def _exit_now(code: int) -> None:
    """Ends the process at once after a clean run: everything is closed by then, and the
    interpreter's own teardown (a final garbage collection over torch, sympy and the compiler
    stack torch's optimizers import) takes seconds of CPU per rank (3.7 s seen on a loaded
    host), which every replica's end and every test pays. The rank's data-loader workers end
    with it (`end_with_this_process`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
