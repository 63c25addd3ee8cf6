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
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from vlforge.config import ConfigError, DataConfig, load_config, SFTConfig
from vlforge.data.dataset import Batching, budget_batches, global_batches, load_dataset
from vlforge.data.encode import IGNORE_INDEX, collate, pack
from vlforge.data.inline import DataError
from vlforge.train import packed_attention
from vlforge.train.inputs import count_tokens, packed_position_ids
from vlforge.train.losses import sft_loss_sum
from vlforge.train.packed_attention import PACKED_ATTENTION, PackedRows, packed_rows_attention
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


class Spy:
    """Counts calls of a module function (monkeypatched), calling through to it."""

    def __init__(self, monkeypatch, module, name):
        self.calls, real = 0, getattr(module, name)

        def wrapper(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("attn,checkpointing", [("sdpa", False), ("sdpa", True), ("eager", False)])
def test_packed_row_gives_the_padded_loss_and_gradients(tiny, mixed, attn, checkpointing, monkeypatch):
    """sdpa: our per-sample attention (train/packed_attention.py), no dense mask built; with
    activation checkpointing too (the recomputed layers get the row's sequences again through their
    kwargs). eager: transformers' block-diagonal mask, the reference."""
    model = copy.deepcopy(tiny[0])
    model.config._attn_implementation = attn  # the text model shares this config object
    model.model.language_model.config._attn_implementation = attn
    if checkpointing:  # as train/trainable.py turns it on (the method's name changed in transformers 5.2x)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ours = Spy(monkeypatch, packed_attention, "packed_rows_attention")
    masks = Spy(monkeypatch, packed_attention, "sdpa_mask")
    data, items = mixed
    assert sum("pixel_values" in x for x in items) == 4 and len(items) == 6
    loss_pad, n_pad, grads_pad = _loss_and_grads(model, collate(items, data.encoder.pad_id))
    packed = pack(items, data.encoder.pad_id, multiple=16)  # with a filler tail after the last sample
    assert packed["input_ids"].shape[0] == 1 and packed["input_ids"].shape[1] % 16 == 0
    assert packed["input_ids"].shape[1] > int(packed["seq_lens"].sum())
    padded_masks = masks.calls
    loss_pack, n_pack, grads_pack = _loss_and_grads(model, packed)
    if attn == "sdpa":  # every decoder layer's attention went per sample (recomputed ones again), no mask built
        layers = model.config.text_config.num_hidden_layers
        assert model.model.language_model.config._attn_implementation == PACKED_ATTENTION
        assert ours.calls == layers * (2 if checkpointing else 1)
        assert masks.calls == padded_masks
    else:
        assert ours.calls == 0
    assert n_pack == n_pad > 0
    assert loss_pack == pytest.approx(loss_pad, rel=1e-6)
    assert grads_pack.keys() == grads_pad.keys()
    assert any(k.startswith("model.visual.") for k in grads_pad)  # the vision tower (deepstack) included
    for name in grads_pad:
        torch.testing.assert_close(grads_pack[name], grads_pad[name], rtol=1e-5, atol=1e-6, msg=name)


def _block_diagonal_reference(q, k, v, lengths, scale):
    """Dense attention with a block-diagonal causal mask (what transformers' sdpa path computes)."""
    T = q.shape[2]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seq[:, None] == seq[None]) & torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def test_packed_rows_attention_equals_the_block_diagonal_mask():
    """GQA (4 query heads on 2 KV heads), a non-default scale, samples of 1..9 tokens and a filler
    tail: the same outputs and gradients as dense attention under the block-diagonal mask."""
    torch.manual_seed(0)
    rows = PackedRows.of([5, 1, 9, 3], 20, torch.device("cpu"))
    assert rows.lengths == (5, 1, 9, 3, 2) and rows.cu_seqlens.tolist() == [0, 5, 6, 15, 18, 20] and rows.max_len == 9
    q = torch.randn(1, 4, 20, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(2))
    out = packed_rows_attention(q, k, v, rows, scaling=0.3)
    ref = _block_diagonal_reference(q, k, v, rows.lengths, 0.3)
    assert out.shape == (1, 20, 4, 8)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for ours, theirs in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(ours, theirs)
    one_sequence = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert not torch.allclose(out, one_sequence.transpose(1, 2))  # not vacuous: the samples are kept apart
    with pytest.raises(ValueError, match="one row of 20 tokens"):
        packed_rows_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19], rows)
    with pytest.raises(ValueError, match="more than the row's 10 tokens"):
        PackedRows.of([5, 6], 10, torch.device("cpu"))


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 14),
                    reason="torch 2.11's dynamo guards on the number of samples handed to the compiler-disabled "
                           "per-sample call (docs/packing.md); 2.14 is the first release this was seen not to")
def test_compiled_layers_do_not_recompile_for_a_new_row_composition(tiny, mixed):
    """Packed rows of one length but different samples: the compiled decoder layers (dynamo, eager
    backend: no codegen on the CPU) trace their graphs once; the row's sequences stay out of them."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(tiny[0])
    data, items = mixed
    for layer in model.model.language_model.layers:
        layer.compile(backend="eager")
    rows = [pack(items[i:j], data.encoder.pad_id, pad_to=640) for i, j in ((0, 3), (3, 6), (1, 2))]
    assert len({tuple(r["seq_lens"].tolist()) for r in rows}) == 3 and {r["input_ids"].shape[1] for r in rows} == {640}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        sft_loss_sum(model, rows[0])
        graphs = counters["stats"]["unique_graphs"]
        for row in rows[1:]:
            sft_loss_sum(model, row)
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


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


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_holds_for_rows_padded_for_fp8(packed):
    """With FP8 every row is padded to a multiple of 16 tokens (train.fp8.token_multiple): the
    budget holds for the batches collate / pack actually build, the fixed packed length
    (flex_attention) included, and a sample that fits only unrounded is refused with what to do."""
    rng = random.Random(3)
    lengths = [rng.randint(5, 100) for _ in range(211)]
    budget = 300  # not a multiple of 16
    batching = Batching(batch_size=1, max_tokens=budget, packed=packed, multiple=16)
    items = [{"input_ids": torch.ones(n, dtype=torch.long), "mm_token_type_ids": torch.zeros(n, dtype=torch.long),
              "labels": torch.ones(n, dtype=torch.long)} for n in lengths]
    batches = [ix[0] for ix, _ in global_batches(lengths, batching, seed=7, epoch=0)]
    assert sorted(i for ix in batches for i in ix) == list(range(len(lengths)))
    for ix in batches:
        rows = [items[i] for i in ix]
        for pad_to in ((None, batching.packed_length) if packed else (None,)):
            batch = pack(rows, 0, multiple=16, pad_to=pad_to) if packed else collate(rows, 0, multiple=16)
            assert batch["input_ids"].numel() <= budget and batch["input_ids"].shape[1] % 16 == 0
    with pytest.raises(DataError, match="295 tokens .*304 as a row padded to a multiple of 16.* at least 304"):
        list(budget_batches([295], budget, packed, seed=0, epoch=0, multiple=16))


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


def test_packed_training_equals_padded_and_keeps_grad_accum_invariance(shapes_dir, tmp_path, monkeypatch):
    """Through the recipe: packed batch 4 x accum 1 == packed batch 2 x accum 2 == padded batch 4;
    with the default sdpa, packed rows go through our per-sample attention and build no mask."""
    common = ["tiers.method=full", "train.max_steps=2", "eval.every=0", "data.val=null"]
    ours = Spy(monkeypatch, packed_attention, "packed_rows_attention")
    masks = Spy(monkeypatch, packed_attention, "sdpa_mask")
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "pad", *common, "train.batch_size=4"))
    assert ours.calls == 0  # data.packing=auto on the CPU: padded rows
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "pack", *common, "train.batch_size=4", "data.packing=true"))
    assert ours.calls == 2 * 2 and masks.calls == 0  # 2 steps x 2 decoder layers
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "mask", *common, "train.batch_size=4", "data.packing=true",
                            "model.attention.implementation=eager"))
    assert ours.calls == 2 * 2  # the reference: transformers' eager attention through its dense block-diagonal mask
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "accum", *common, "train.batch_size=2", "train.grad_accum=2",
                            "data.packing=true"))
    pad = _final(tmp_path / "pad")
    for other in ("pack", "accum"):
        weights = _final(tmp_path / other)
        for name in pad:
            torch.testing.assert_close(weights[name], pad[name], atol=2e-6, rtol=1e-5, msg=f"{other}: {name}")
        assert _losses(tmp_path / other) == pytest.approx(_losses(tmp_path / "pad"), rel=1e-5)


def test_packing_auto_packs_where_the_varlen_flash_kernel_runs(tiny, monkeypatch):
    """data.packing=auto resolves per model and device: a CUDA device of sm80+ with sdpa's per-sample
    attention packs; the CPU, an older GPU, and eager attention (a dense mask) do not. An
    unresolved auto never reaches the batching."""
    model = copy.deepcopy(tiny[0])
    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: index == 0)  # device 0 is an sm80+ GPU
    assert packed_attention.packing_pays(model, torch.device("cuda", 0))
    assert not packed_attention.packing_pays(model, torch.device("cuda", 1))  # sm75: no flash kernels
    assert not packed_attention.packing_pays(model, torch.device("cpu"))
    assert not packed_attention.packing_pays(model, torch.device("cuda", 0), "fp32")  # the kernel is half precision
    assert packed_attention.packing_pays(model, torch.device("cuda", 0), "fp16")
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: None)  # a torch without varlen_attn
    assert not packed_attention.packing_pays(model, torch.device("cuda", 0))
    monkeypatch.undo()
    monkeypatch.setattr(packed_attention, "flash_capable", lambda index: True)
    eager = copy.deepcopy(model)
    eager.model.language_model.config._attn_implementation = "eager"
    assert not packed_attention.packing_pays(eager, torch.device("cuda", 0))
    cfg = load_config(SFTConfig, None, [])
    assert cfg.data.packing == "auto"
    with pytest.raises(ValueError, match="must be resolved"):
        Batching.of(cfg.data, 4)
    assert Batching.of(cfg.data, 4, packed=True).packed
    assert Batching.of(load_config(SFTConfig, None, ["data.packing=false"]).data, 4).packed is False


def test_the_recipe_packs_where_packing_pays_and_resumes_only_as_it_packed(shapes_dir, tmp_path, monkeypatch, capsys):
    """Through the recipe: data.packing=auto packs where packing_pays says so (its startup line says
    "packed rows") and records it in the checkpoint; a resume where auto decides otherwise is refused
    with a token budget (other micro-batches, another step count), noted without one."""
    import vlforge.recipes.sft as sft

    ours = Spy(monkeypatch, packed_attention, "packed_rows_attention")
    common = ["tiers.method=full", "eval.every=0", "data.val=null", "data.max_length=200"]
    for name, batching in (("budget", "data.max_tokens_per_batch=400"), ("fixed", "train.batch_size=4")):
        monkeypatch.setattr(sft, "packing_pays", lambda core, device, precision: True)  # as on a GPU
        out = tmp_path / name
        run_sft(tiny_sft_config(shapes_dir, out, *common, batching, "train.max_steps=1"))
        assert ours.calls > 0 and "packed rows (data.packing)" in capsys.readouterr().out
        ours.calls = 0
        monkeypatch.setattr(sft, "packing_pays", lambda core, device, precision: False)  # resumed elsewhere
        resume = tiny_sft_config(shapes_dir, out, *common, batching, "train.max_steps=2", "train.resume=auto")
        if name == "budget":
            with pytest.raises(ConfigError, match="set data.packing=true to resume it exactly"):
                run_sft(resume)
            assert (out / "checkpoint-1").is_dir()  # the finished checkpoint is kept
        else:
            assert run_sft(resume)["final_step"] == 2 and ours.calls == 0
            assert "the same samples a micro-batch" in capsys.readouterr().out


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


@pytest.mark.gpu
def test_varlen_attention_in_bf16_matches_the_padded_batch(tiny, mixed, monkeypatch):
    """On CUDA in bf16, packed rows run torch's varlen_attn (counted: not the per-sample fallback)
    and give the padded batch's loss and gradients within bf16 tolerance."""
    data, items = mixed
    model = copy.deepcopy(tiny[0]).to("cuda", torch.bfloat16)
    varlen = Spy(monkeypatch, packed_attention, "_varlen_call")
    cuda = lambda b: {k: v.to("cuda") for k, v in b.items()}  # the model casts pixel_values to its own dtype
    loss_pad, n_pad, grads_pad = _loss_and_grads(model, cuda(collate(items, data.encoder.pad_id)))
    loss_pack, n_pack, grads_pack = _loss_and_grads(model, cuda(pack(items, data.encoder.pad_id, multiple=16)))
    assert model.model.language_model.config._attn_implementation == PACKED_ATTENTION
    assert varlen.calls == model.config.text_config.num_hidden_layers
    assert n_pack == n_pad and loss_pack == pytest.approx(loss_pad, rel=2e-2)
    for name in grads_pad:
        a, b = grads_pack[name].float(), grads_pad[name].float()
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6, name


@pytest.mark.gpu
def test_varlen_attention_runs_under_autocast_with_fp32_weights(tiny, mixed, monkeypatch):
    """fp32 master weights under bf16 autocast (the recipes' default): q/k RMSNorm hands the
    attention fp32 queries; packed rows must still take varlen_attn (in bf16, as SDPA would under
    autocast), not the per-sample fallback, and match the padded batch."""
    data, items = mixed
    model = copy.deepcopy(tiny[0]).to("cuda", torch.float32)
    varlen = Spy(monkeypatch, packed_attention, "_varlen_call")
    cuda = lambda b: {k: v.to("cuda") for k, v in b.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_pad, n_pad, grads_pad = _loss_and_grads(model, cuda(collate(items, data.encoder.pad_id)))
        loss_pack, n_pack, grads_pack = _loss_and_grads(model, cuda(pack(items, data.encoder.pad_id, multiple=16)))
    assert varlen.calls == model.config.text_config.num_hidden_layers
    assert n_pack == n_pad and loss_pack == pytest.approx(loss_pad, rel=2e-2)
    for name in grads_pad:
        a, b = grads_pack[name].float(), grads_pad[name].float()
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6, name


@pytest.mark.gpu
def test_compiled_layers_trace_varlen_without_a_graph_break(tiny, mixed):
    """On CUDA the varlen call is inside the compiled decoder layers' graphs (torch's custom op):
    no graph break, no recompile for a new row composition or a new longest sample once the
    number of sequences has gone dynamic, and the eager loss (rows.max_len) within bf16 tolerance
    of the compiled one (the row length as the kernel's bound)."""
    from torch._dynamo.utils import counters

    data, items = mixed
    model = copy.deepcopy(tiny[0]).to("cuda", torch.bfloat16)
    cuda = lambda b: {k: v.to("cuda") for k, v in b.items()}
    rows = [cuda(pack(items[i:j], data.encoder.pad_id, pad_to=640)) for i, j in ((0, 3), (3, 6), (1, 2), (0, 2), (2, 4))]
    with torch.no_grad():
        eager = [float(sft_loss_sum(model, r)[0]) for r in rows]
    for layer in model.model.language_model.layers:
        layer.compile()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = [float(sft_loss_sum(model, r)[0]) for r in rows[:3]]  # 3 rows: the sequence count changes once
        graphs = counters["stats"]["unique_graphs"]
        compiled += [float(sft_loss_sum(model, r)[0]) for r in rows[3:]]
    assert model.model.language_model.config._attn_implementation == PACKED_ATTENTION
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs
    assert compiled == pytest.approx(eager, rel=2e-2)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "fp32+autocast"])
def test_compiled_varlen_attention_equals_per_sample_sdpa(weights):
    """The compiled varlen call (the row length as the kernel's bound) on rows of different lengths
    and compositions equals causal SDPA run on each sample alone, outputs and q/k/v gradients, in
    bf16 and with fp32 inputs under bf16 autocast (the recipes' fp32 master weights); no graph
    break, and no new graph once the row length and the sequence count have gone dynamic."""
    from torch._dynamo.utils import counters

    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    compiled = torch.compile(packed_rows_attention)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    compositions = ([300, 17, 140], [90, 400], [5, 61, 222, 30, 8], [128, 128, 64, 33], [500, 3, 77])
    for i, lengths in enumerate(compositions):
        T = sum(lengths)
        q, k, v = (torch.randn(1, h, T, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
                   for h in (8, 2, 2))
        rows = PackedRows.of(lengths, T, torch.device("cuda"))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            out = compiled(q, k, v, rows, scaling=0.125)
        cuts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        ref = torch.cat([F.scaled_dot_product_attention(*(x[:, :, a:b].bfloat16() for x in (q, k, v)), is_causal=True,
                                                        scale=0.125, enable_gqa=True)
                         for a, b in zip(cuts, cuts[1:])], dim=2).transpose(1, 2)
        assert out.dtype == torch.bfloat16 and out.shape == (1, T, 8, 64)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        grad = torch.randn_like(ref)
        ours, theirs = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
        for a, b in zip(ours, theirs):
            assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs  # compositions 4 and 5: no new graph
    torch._dynamo.reset()
