"""A plain FSDP2 training script: `torchrun --nproc-per-node 2 examples/fsdp2_train.py`.

`fsdp2_train_fthsdp.py` is the same script on fthsdp (diff the two)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from toy import ToyDataset, build_model, forever, parse_args, pick_device, warmup


def main() -> None:
    args = parse_args()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = pick_device()
    model = build_model().to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(20))
    dataset = ToyDataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)  # fmt: skip
    batches = forever(loader, sampler)
    step = 0
    while step < args.steps:
        x, y = (t.to(device) for t in next(batches))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    print(f"rank {rank} done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
