"""Each rank's RNG after a resume (torchrun, gloo, tiny model): its own saved stream on the world
size that saved it; on a larger world a fresh stream from (train.seed, step, rank) for each new
rank, never a copy of rank 0's; rank 0's on every rank where the recipe keeps one stream in
lockstep (GRPO: `shared_rng`). On a fresh start, rank r > 0 leaves the common seed for the
stream of (train.seed, 0, r) (GRPO: not). One 2-rank launch runs every case (this file is its script).
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlforge.train.rng import rank_seed, read_rng, restore_rng, rng_state
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

TIMEOUT_S = 240
COMMON = ["model.preset=tiny", "precision.mode=fp32", "train.device=cpu", "log.progress=false", "data.val=null",
          "train.seed=0", "tiers.method=lora", "tiers.language.dropout=0.1", "train.batch_size=2", "train.max_steps=1",
          "train.save_every=1", "tiers.vision.train=true"]
# name -> (checkpoint under the test's tmp_path, distributed.strategy of the resuming run, shared_rng)
CASES = {
    "same-world": ("two/checkpoint-1", "fsdp2", False),  # saved on these 2 ranks
    "grown-sharded": ("one-fsdp2/checkpoint-1", "fsdp2", False),  # saved by FSDP2 on one process
    "grown-ddp": ("one/checkpoint-1", "ddp", False),  # a one-process checkpoint on 2 DDP ranks
    "grown-shared": ("one/checkpoint-1", "ddp", True),  # the same, GRPO's lockstep stream
    "fresh": (None, "fsdp2", False),  # no checkpoint: rank 1 leaves the common seed for its own stream
    "fresh-shared": (None, "ddp", True),  # no checkpoint, GRPO: every rank the same stream
}


def probe(tmp: str, train_jsonl: str) -> None:
    """Under torchrun: train 1 step on 2 ranks (tmp/two), then resume each CASES checkpoint and save
    every rank's RNG right after Run.start to tmp/NAME-RANK.pt."""
    from vlforge.config import DistributedConfig, SFTConfig, load_config
    from vlforge.train.distributed import init_world
    from vlforge.train.run import Run
    from vlforge.train.runtime import seed_everything
    from vlforge.train.trainable import setup_model

    tmp = Path(tmp)
    group = init_world(DistributedConfig(strategy="fsdp2"), "cpu")  # one process group for every run below
    run_sft(load_config(SFTConfig, None, [*COMMON, f"data.train={train_jsonl}", f"train.output_dir={tmp / 'two'}"]))
    for name, (checkpoint, strategy, shared) in CASES.items():
        out = tmp / f"probe-{name}"
        out.mkdir(exist_ok=True)
        cfg = load_config(SFTConfig, None, [*COMMON, f"data.train={train_jsonl}", f"train.output_dir={out}",
                                            f"distributed.strategy={strategy}"])
        world = init_world(cfg.distributed, cfg.train.device)
        seed_everything(cfg.train.seed)  # as begin_run does
        t = setup_model(cfg, world=world)
        Run.start(cfg, t, 4, None, checkpoint and tmp / checkpoint, spikes=True, shared_rng=shared)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / f"{name}-{world.rank}.pt")
    group.close()


def _fresh(seed: int, step: int, rank: int) -> dict:
    torch.manual_seed(rank_seed(seed, step, rank))
    random.seed(rank_seed(seed, step, rank))
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]


@pytest.mark.parametrize("rank0_file", ["rng.pt", "rng-0.pt"])  # one-process / DDP, sharded
def test_restore_rng_own_fresh_or_shared(tmp_path, rank0_file):
    """restore_rng on checkpoint files of two saved ranks: ranks 0 and 1 get their own states back,
    rank 2 (not in the saving run) a fresh stream of its own, and with `shared` every rank rank 0's."""
    states = []
    for rank, name in enumerate((rank0_file, "rng-1.pt")):
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        states.append(rng_state())
        torch.save(states[-1], tmp_path / name)
    for rank in (0, 1):
        torch.manual_seed(7)
        assert restore_rng(tmp_path, rank, seed=0, step=5) and _same(rng_state(), states[rank])
    assert not restore_rng(tmp_path, 2, seed=0, step=5)
    assert _same(rng_state(), _fresh(0, 5, 2)) and not _same(_fresh(0, 5, 2), states[0])
    assert not _same(_fresh(0, 5, 2), _fresh(0, 6, 2)) and not _same(_fresh(0, 5, 2), _fresh(1, 5, 1))
    for rank in (1, 2):
        assert restore_rng(tmp_path, rank, seed=0, step=5, shared=True) and _same(rng_state(), states[0])


@pytest.mark.slow  # one 2-rank launch and two one-process runs, ~45 s of CPU
def test_resumed_ranks_get_their_own_or_a_fresh_rng_stream(shapes_dir, tmp_path):
    for name, extra in (("one", []), ("one-fsdp2", ["distributed.strategy=fsdp2"])):  # one process each
        run_sft(tiny_sft_config(shapes_dir, tmp_path / name, *COMMON, *extra))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             __file__, str(tmp_path), str(shapes_dir / "train.jsonl")], env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    load = lambda path: read_rng(path)[0]  # noqa: E731  (a checkpoint's rng file, or the probe's in the same form)
    got = {name: [load(tmp_path / f"{name}-{r}.pt") for r in (0, 1)] for name in CASES}
    saved = {name: load(tmp_path / name) for name in ("two/checkpoint-1/rng-0.pt", "two/checkpoint-1/rng-1.pt",
                                                      "one-fsdp2/checkpoint-1/rng-0.pt", "one/checkpoint-1/rng.pt")}
    # the same world size: each rank its own stream, exactly (the two differ: dropout on different rows)
    assert not _same(saved["two/checkpoint-1/rng-0.pt"], saved["two/checkpoint-1/rng-1.pt"])
    assert [_same(got["same-world"][r], saved[f"two/checkpoint-1/rng-{r}.pt"]) for r in (0, 1)] == [True, True]
    # a larger world: rank 0 continues, the new rank 1 starts a fresh stream of its own (not rank 0's)
    for name, rank0 in (("grown-sharded", "one-fsdp2/checkpoint-1/rng-0.pt"), ("grown-ddp", "one/checkpoint-1/rng.pt")):
        assert _same(got[name][0], saved[rank0]), name
        assert _same(got[name][1], _fresh(0, 1, 1)), name
        assert not _same(got[name][1], got[name][0]), name
    # GRPO's lockstep stream: every rank rank 0's
    assert all(_same(got["grown-shared"][r], saved["one/checkpoint-1/rng.pt"]) for r in (0, 1))
    # a fresh start: rank 1 its own stream (different dropout masks), rank 0 the common one; GRPO: the same
    assert _same(got["fresh"][1], _fresh(0, 0, 1)) and not _same(got["fresh"][0], got["fresh"][1])
    assert _same(got["fresh-shared"][0], got["fresh-shared"][1]) and _same(got["fresh-shared"][0], got["fresh"][0])
    assert "exact resume needs 1 process(es)" in result.stdout  # the note of a resume on another world size


if __name__ == "__main__":  # torchrun tests/test_distributed_rng.py TMP TRAIN_JSONL (the probe)
    probe(sys.argv[1], sys.argv[2])
