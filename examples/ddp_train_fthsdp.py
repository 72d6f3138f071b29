"""`ddp_train.py` on fthsdp: one torchrun job per replica, each replica a unit of failure.

    set -a; . runs/up/fthsdp.env; set +a       # from `fthsdp up`
    FTHSDP_REPLICA_ID=r0 FTHSDP_REPLICA_INDEX=0 FTHSDP_TOTAL_REPLICAS=2 \\
        torchrun --nproc-per-node 2 --master-port 29500 examples/ddp_train_fthsdp.py

and the same with r1 / index 1 (another --master-port) for the second replica. Or let `fthsdp up`
run the replicas, with warm spares that take over a failed replica's ranks at once:

    fthsdp up --replicas 2 --ranks 2 --spares 2 -- python examples/ddp_train_fthsdp.py"""

import torch
import torch.distributed as dist
from toy import ToyDataset, build_model, parse_args, pick_device, warmup

import fthsdp


def main() -> None:
    args = parse_args()
    fthsdp.take_identity()  # a warm spare (fthsdp up --spares) waits here to become a rank
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device()
    model = build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(20))
    dataset = ToyDataset()
    manager = fthsdp.Manager(config=fthsdp.ManagerConfig.from_env(), model=model,
        optimizer=optimizer, group=fthsdp.ReplicaGroup.from_torch(),
        samples_per_step=args.batch_size * world, state={"scheduler": scheduler})  # fmt: skip
    optimizer = fthsdp.OptimizerWrapper(manager)
    loader = fthsdp.ExactlyOnceDataLoader(dataset, manager, args.batch_size, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0)  # fmt: skip
    batches = iter(loader)
    step = manager.step
    while step < args.steps:
        x, y = (t.to(device) for t in next(batches))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        step = manager.step
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    print(f"rank {rank} done at step {step} fingerprint {manager.fingerprint()}", flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main()
