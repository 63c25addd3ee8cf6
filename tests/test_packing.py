"""Padding-free packing (data.packing) and token-budget batches (data.max_tokens_per_batch).

Parity on the tiny model in fp32: a packed row gives the loss and every gradient of the padded
batch of the same samples (multi-image, differently sized, text-only and multi-turn samples);
per-sample M-RoPE equals each sample's own; budget batches cover an epoch exactly once, resume
exactly and give every rank the same number of micro-batches; grad accumulation stays invariant.
"""

import copy
import json
import random

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from vlforge.config import ConfigError, DataConfig, load_config, SFTConfig
from vlforge.data.dataset import Batching, budget_batches, global_batches, load_dataset
from vlforge.data.encode import IGNORE_INDEX, collate, pack
from vlforge.engine.losses import count_tokens, packed_position_ids, sft_loss_sum
from vlforge.recipes.sft import micro_batches, run_sft

from helpers import tiny_sft_config


@pytest.fixture(scope="module")
def mixed_jsonl(shapes_dir, tmp_path_factory):
    """Rows with 0-3 images of three sizes (different grids), one of them a multi-turn conversation."""
    out = tmp_path_factory.mktemp("mixed")
    rng = random.Random(0)
    for name, size in (("wide.png", (96, 64)), ("tall.png", (64, 128))):
        Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(out / name)
    shape = lambda i: str(shapes_dir / "images" / f"{i:06d}.png")
    rows = [
        {"images": [shape(1), str(out / "wide.png")], "text": "Compare the two images.", "answer": "two shapes"},
        {"text": "Say hello without any image.", "answer": "hello there"},
        {"images": [str(out / "tall.png"), shape(2), shape(3)], "text": "How many?", "answer": "3"},
        {"image": shape(4), "text": "What colour is the shape?", "answer": "blue"},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": shape(5)},
                                                   {"type": "text", "text": "Shape?"}]},
                      {"role": "assistant", "content": "circle"},
                      {"role": "user", "content": "And its colour?"},
                      {"role": "assistant", "content": "red, I think"}]},
        {"text": "Count to three.", "answer": "one two three"},
    ]
    path = out / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mixed(tiny, mixed_jsonl):
    _, processor = tiny
    data = load_dataset(str(mixed_jsonl), processor, DataConfig())
    return data, [data[i] for i in range(len(data))]


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, n = sft_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_gives_the_padded_loss_and_gradients(tiny, mixed, attn):
    model = copy.deepcopy(tiny[0])
    model.config._attn_implementation = attn  # the text model shares this config object
    model.model.language_model.config._attn_implementation = attn
    data, items = mixed
    assert sum("pixel_values" in x for x in items) == 4 and len(items) == 6
    loss_pad, n_pad, grads_pad = _loss_and_grads(model, collate(items, data.encoder.pad_id))
    packed = pack(items, data.encoder.pad_id, multiple=16)  # with a filler tail after the last sample
    assert packed["input_ids"].shape[0] == 1 and packed["input_ids"].shape[1] % 16 == 0
    assert packed["input_ids"].shape[1] > int(packed["seq_lens"].sum())
    loss_pack, n_pack, grads_pack = _loss_and_grads(model, packed)
    assert n_pack == n_pad > 0
    assert loss_pack == pytest.approx(loss_pad, rel=1e-6)
    assert grads_pack.keys() == grads_pad.keys()
    assert any(k.startswith("model.visual.") for k in grads_pad)  # the vision tower (deepstack) included
    for name in grads_pad:
        torch.testing.assert_close(grads_pack[name], grads_pad[name], rtol=1e-5, atol=1e-6, msg=name)


def test_packing_without_per_sample_positions_differs(tiny, mixed):
    """The parity above is not vacuous: the same row with one causal sequence (no per-sample
    positions) attends across samples and gives another loss."""
    model = tiny[0]
    data, items = mixed
    with torch.no_grad():
        padded, _ = sft_loss_sum(model, collate(items, data.encoder.pad_id))
        packed = pack(items, data.encoder.pad_id)
        one_sequence, _ = sft_loss_sum(model, {k: v for k, v in packed.items() if k != "seq_lens"})
    assert abs(float(one_sequence) - float(padded)) > 1e-3 * abs(float(padded))


def test_packed_mrope_restarts_per_sample(tiny, mixed):
    model = tiny[0]
    data, items = mixed
    packed = pack(items, data.encoder.pad_id, multiple=16)
    lens = packed["seq_lens"].tolist()
    pos = packed_position_ids(model, packed["input_ids"], packed["mm_token_type_ids"],
                              packed.get("image_grid_thw"), lens)
    T = packed["input_ids"].shape[1]
    assert pos.shape == (4, 1, T)
    start, image = 0, 0
    for x, n in zip(items, lens):
        images = len(x.get("image_grid_thw", []))
        alone, _ = model.model.get_rope_index(x["input_ids"][None], x["mm_token_type_ids"][None],
                                              image_grid_thw=x.get("image_grid_thw"))
        assert torch.equal(pos[1:, 0, start:start + n], alone[:, 0])
        assert torch.equal(pos[0, 0, start:start + n], torch.arange(n))  # text positions: what the mask reads
        if images:  # 3-D image positions: the rows differ inside image spans
            assert not torch.equal(alone[1], alone[2])
        start, image = start + n, image + images
    assert torch.equal(pos[:, 0, start:], torch.arange(T - start).expand(4, -1))  # the filler: its own sequence
    # labels: each sample's first position never supervised; the filler's none
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    assert (packed["labels"][0, starts] == IGNORE_INDEX).all() and (packed["labels"][0, start:] == IGNORE_INDEX).all()
    assert count_tokens(packed) == sum(lens) == count_tokens(collate(items, data.encoder.pad_id))


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_batches_cover_each_sample_once_and_resume(packed):
    rng = random.Random(1)
    lengths = [rng.randint(5, 100) for _ in range(211)]
    budget = 300
    for epoch in range(3):
        batches = list(budget_batches(lengths, budget, packed, seed=7, epoch=epoch))
        seen = [i for ix, _ in batches for i in ix]
        assert sorted(seen) == list(range(len(lengths)))  # every sample exactly once
        for ix, _ in batches:
            cost = sum(lengths[i] for i in ix) if packed else len(ix) * max(lengths[i] for i in ix)
            assert cost <= budget
        assert batches[-1][1] == len(lengths)
        # resuming from any batch boundary continues exactly as the uninterrupted epoch
        k = len(batches) // 2
        assert list(budget_batches(lengths, budget, packed, seed=7, epoch=epoch, start=batches[k - 1][1])) == batches[k:]
    assert list(budget_batches(lengths, budget, packed, 7, 0)) != list(budget_batches(lengths, budget, packed, 7, 1))
    assert len(list(budget_batches(lengths, budget, True, 7, 0))) < len(list(budget_batches(lengths, budget, False, 7, 0)))


def test_every_rank_gets_the_same_number_of_micro_batches():
    rng = random.Random(2)
    lengths = [rng.randint(5, 100) for _ in range(97)]
    batching = Batching(batch_size=1, max_tokens=250, packed=True)
    one = [ix[0] for ix, _ in global_batches(lengths, batching, 0, 0, world_size=1)]
    for world in (2, 3):
        groups = list(global_batches(lengths, batching, 0, 0, world_size=world))
        assert all(len(ix) == world and all(ix) for ix, _ in groups)
        # the same batches as one process, in the same order, dealt round the ranks (tail dropped)
        assert [b for ix, _ in groups for b in ix] == one[:len(groups) * world]
        assert len(one) - len(groups) * world < world


def test_micro_batch_stream_resumes_exactly(tiny, mixed_jsonl):
    _, processor = tiny
    data = load_dataset(str(mixed_jsonl), processor, DataConfig())
    batching = Batching(batch_size=1, max_tokens=400, packed=True)
    stream = micro_batches(data, batching, seed=3, epoch=0, position=0, num_workers=0)
    straight = [next(stream) for _ in range(8)]  # runs into later epochs
    _, epoch, position = straight[2]
    resumed = micro_batches(data, batching, seed=3, epoch=epoch, position=position, num_workers=0)
    for (a, ea, pa), (b, eb, pb) in zip(straight[3:], resumed):
        assert (ea, pa) == (eb, pb) and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all("seq_lens" in b and b["input_ids"].shape[0] == 1 for b, _, _ in straight)
    assert all(int(b["seq_lens"].sum()) <= 400 for b, _, _ in straight)


def _final(out):
    return load_file(out / "checkpoint-2" / "model.safetensors")


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_packed_training_equals_padded_and_keeps_grad_accum_invariance(shapes_dir, tmp_path):
    """Through the recipe: packed batch 4 x accum 1 == packed batch 2 x accum 2 == padded batch 4."""
    common = ["tiers.method=full", "train.max_steps=2", "eval.every=0", "data.val=null"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "pad", *common, "train.batch_size=4"))
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "pack", *common, "train.batch_size=4", "data.packing=true"))
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "accum", *common, "train.batch_size=2", "train.grad_accum=2",
                            "data.packing=true"))
    pad = _final(tmp_path / "pad")
    for other in ("pack", "accum"):
        weights = _final(tmp_path / other)
        for name in pad:
            torch.testing.assert_close(weights[name], pad[name], atol=2e-6, rtol=1e-5, msg=f"{other}: {name}")
        assert _losses(tmp_path / other) == pytest.approx(_losses(tmp_path / "pad"), rel=1e-5)


def test_token_budget_training_runs_with_lora(shapes_dir, tmp_path):
    result = run_sft(tiny_sft_config(shapes_dir, tmp_path, "train.max_steps=2", "eval.every=0", "data.val=null",
                                     "data.packing=true", "data.max_tokens_per_batch=400", "data.max_length=200"))
    assert result["final_step"] == 2
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] > 0 for r in rows if "loss" in r)


def test_budget_below_max_length_is_refused():
    with pytest.raises(ConfigError, match="max_tokens_per_batch=100 is below data.max_length=2048"):
        load_config(SFTConfig, None, ["data.max_tokens_per_batch=100"])


@pytest.mark.slow
def test_packed_token_budget_on_two_ranks_equals_one_process(shapes_dir, mixed_jsonl, tmp_path):
    """FSDP2 (torchrun, gloo): 2 ranks x accum 1 == 1 process x accum 2 with packed token-budget
    batches: the same budget batches, dealt round the ranks, make the same steps. The data mixes
    text-only rows with multi-image ones, so a rank's row may lack images (vision keep-alive)."""
    import os
    import subprocess
    import sys

    rows = [json.loads(line) for line in mixed_jsonl.read_text().splitlines()] * 4
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["model.preset=tiny", "precision.mode=fp32", "train.device=cpu", "log.progress=false",
              "optim.schedule=constant", "optim.warmup_steps=0", "tiers.method=full", "tiers.vision.train=true",
              "train.max_steps=2", "data.packing=true", "data.max_tokens_per_batch=300", "data.max_length=300",
              f"data.train={train}"]
    one = tmp_path / "one"
    run_sft(load_config(SFTConfig, None, [*common, f"train.output_dir={one}", "train.grad_accum=2"]))
    two = tmp_path / "two"
    (tmp_path / "run.yaml").write_text(f"data: {{train: {train}}}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "vlforge", "sft", str(tmp_path / "run.yaml"), *common,
                           f"train.output_dir={two}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)


def test_pack_pads_to_a_fixed_length_rounded_to_the_multiple(mixed):
    data, items = mixed
    total = sum(len(x["input_ids"]) for x in items)
    row = pack(items, data.encoder.pad_id, multiple=16, pad_to=total + 3)
    assert row["input_ids"].shape == (1, -(-(total + 3) // 16) * 16)
    with pytest.raises(ValueError, match="do not fit"):
        pack(items, data.encoder.pad_id, pad_to=total - 1)
