"""torchrun --nproc_per_node 2 tests/fsdp2_scaler_probe.py OUT: fp16 loss scaling on FSDP2 shards,
an inf in rank 1's shard only (tests/test_distributed.py runs it)."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from vlforge.config import HealthConfig, PrecisionConfig
from vlforge.train.health import GradHealth
from vlforge.train.precision import PrecisionPolicy


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the CPU even where a GPU is visible
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = PrecisionPolicy(PrecisionConfig(mode="fp16"), "cpu").grad_scaler()
    health = GradHealth(model, [], HealthConfig(), precision_mode="fp16")
    rows, moved = [], []
    for step in range(2):
        before = [p.full_tensor().clone() for p in model.parameters()]
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 0 and rank == 1:  # one element of one rank's shard: the other rank's are finite
            next(model.parameters()).grad._local_tensor.view(-1)[0] = float("inf")
        rows.append({k: v for k, v in health.step(optimizer, scaler, None, float(loss.detach())).items()
                     if k in ("skipped", "loss_scale")})
        moved.append(any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters())))
    weights = [p.full_tensor() for p in model.parameters()]
    json.dump({"rows": rows, "moved": moved, "scale": scaler.get_scale(),
               "weights": [w.tolist() for w in weights]}, open(f"{out}/scaler-{rank}.json", "w"))
    dist.barrier()  # leave together (train/distributed.World.close says why; 2 aborts in 14 runs without)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
