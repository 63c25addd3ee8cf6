"""torchrun --nproc_per_node N tests/fsdp2_8bit_probe.py OUT TAG STEPS [SAVE_AT] [RESUME_FROM]: bitsandbytes'
8-bit AdamW on FSDP2 shards (train/optim.sharded_8bit), saved and resumed through DCP on any number of
ranks (tests/test_optim.py runs it). Every step's batch is the same 8 rows whatever the world size,
split over the ranks; rank 0 writes OUT/TAG.pt: the weights after each step and each tensor's moment
dtype. TAG `plain`: no FSDP2, bitsandbytes' AdamW8bit as it is."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vlforge.config import OptimConfig
from vlforge.train.optim import build_optimizer


def build() -> torch.nn.Module:
    # rows of whole 256-value blocks (8-bit: 37 rows split 19/18; a single row, which rank 1 holds none
    # of) and rows that are not (fp32 moments: 37-wide rows, biases)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 37), torch.nn.Linear(37, 4096), torch.nn.Tanh(),
                               torch.nn.Linear(4096, 1))


def main(out: str, tag: str, steps: int, save_at: int = 0, resume_from: str = "") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    if tag != "plain":  # plain: bitsandbytes' own 8-bit AdamW on the unsharded model (one process)
        mesh = init_device_mesh("cpu", (world,))  # the CPU even where a GPU is visible (fully_shard's default)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = build_optimizer([{"params": list(model.parameters()), "lr": 1e-2, "weight_decay": 0.1}],
                                OptimConfig(name="adamw8bit"), "cpu")
    start, history = 0, []
    if resume_from:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=resume_from)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        start = int(state["optim"]["state"]["0.weight"]["step"])
    for step in range(start, steps):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        model(x).pow(2).mean().backward()  # the mean over this rank's rows: FSDP2 averages the ranks'
        optimizer.step()
        optimizer.zero_grad()
        history.append({n: (p.full_tensor() if tag != "plain" else p).detach().clone()
                        for n, p in model.named_parameters()})
        if step + 1 == save_at:
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=f"{out}/{tag}-dcp")
    moments = {n: optimizer.state[p]["state1"].dtype for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"weights": history, "moments": moments}, f"{out}/{tag}.pt")
    dist.barrier()  # leave together (train/distributed.World.close says why)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]), *sys.argv[5:6])
