"""Host-device syncs of one SFT training step and of GRPO's log-prob forward, counted on the CPU
(tests/syncs.py says how).

Every sync stalls the CPU until the GPU has drained, then the GPU starves while the CPU launches
the next kernels. vlforge's own code reads what it needs on the host from the batch's CPU copy
(train/inputs.step_inputs) and reads the step's metrics once per optimizer step; what remains
in its frames is pinned here, so a change that adds a sync fails. The library's are printed by

    PYTHONPATH=. python tests/test_host_syncs.py      # per call site, padded and packed
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from syncs import SyncCounter  # noqa: E402

# vlforge's own syncs per optimizer step: the per-group gradient norms, read once (GradHealth decides
# skip and clip from them on the host), and the step's loss, read once
OURS = {("tolist", "vlforge/train/health.py"): 1, ("item", "vlforge/recipes/sft.py"): 1}


def _step(shapes_dir, tmp_path, packing: bool, steps: int = 1, prepare: bool = False):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate, pack
    from vlforge.train.health import GradHealth
    from vlforge.train.inputs import HostPrep
    from vlforge.train.optim import build_optimizer
    from vlforge.train.trainable import setup_model
    from vlforge.model.tiers import param_groups
    from vlforge.recipes.sft import train_step

    from helpers import tiny_sft_config

    cfg = tiny_sft_config(shapes_dir, tmp_path, f"data.packing={str(packing).lower()}", "train.grad_accum=2")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    scaler, health = t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode)
    join = pack if packing else collate
    micro = [join([data[i] for i in range(k, k + 3)], data.encoder.pad_id) for k in (0, 3)]
    if prepare:  # as the recipe's loader hands them over (HostPrep in its workers)
        micro = [HostPrep.of(t.model)(b) for b in micro]
    train_step(t, micro, optimizer, scaler, health, 1.0, cfg.loss)  # first step: lazy state
    counters = []
    for _ in range(steps):
        with SyncCounter(t.model, t.device) as syncs:
            row = train_step(t, micro, optimizer, scaler, health, 1.0, cfg.loss)
        counters.append(syncs)
    return counters, row


def _ours(syncs) -> dict:
    out = {}
    for (kind, site), n in syncs.by_site(ours_only=True).items():
        key = (kind, site.split(":")[0])
        out[key] = out.get(key, 0) + n
    return out


# transformers' syncs left in a step with images: packed rows' sequence detection (masking_utils), once a
# forward. Gone (model/host_inputs.py): the image tokens' count check and the deepstack layers' boolean
# indexing (Placeholders), and the padded batch's check for padding (causal_padding_mask).
LIBRARY = {False: set(), True: {"find_packed_sequence_indices"}}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_vlforge_syncs_per_step(shapes_dir, tmp_path, packing):
    (syncs,), row = _step(shapes_dir, tmp_path, packing)
    assert row["loss"] > 0 and row["supervised_tokens"] > 0
    assert syncs.total() > 0  # the counter sees vlforge's syncs: it can fail
    assert _ours(syncs) == OURS, syncs.table()
    library = {site.split()[-1] for (_, site) in syncs.by_site() if not site.startswith("vlforge/")}
    assert library == LIBRARY[packing], syncs.table()


def test_host_inputs_are_what_the_model_computes(tiny, shapes_dir):
    """step_inputs' host-computed position ids, vision grid inputs, label positions, image token
    positions and attention mask give the loss and every gradient of transformers' own forward
    (which computes them itself) bit for bit."""
    import copy

    from vlforge.config import DataConfig
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate

    model, processor = copy.deepcopy(tiny[0]), tiny[1]
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    for rows in (3, 1):  # rows of several lengths (padding: our 4-D mask), one row (no padding: no mask)
        _host_inputs_give_the_models_loss_and_gradients(model, collate([data[i] for i in range(rows)],
                                                                       data.encoder.pad_id), padding=rows > 1)


def _host_inputs_give_the_models_loss_and_gradients(model, batch, padding: bool):
    import torch
    import torch.nn.functional as F

    from vlforge.config import LossConfig
    from vlforge.data.encode import IGNORE_INDEX
    from vlforge.train.inputs import step_inputs
    from vlforge.train.losses import sft_loss_sum

    assert "pixel_values" in batch

    def grads():
        out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                                    "image_grid_thw")}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    supervised = batch["labels"][:, 1:] != IGNORE_INDEX
    ref = F.cross_entropy(model.lm_head(hidden[:, :-1][supervised]).float(), batch["labels"][:, 1:][supervised],
                          reduction="sum")
    ref.backward()
    ref_grads = grads()
    prepared = step_inputs(model, batch, torch.device("cpu"))
    host = prepared["host"]  # the host path is the one taken
    assert "position_ids" in prepared and host.vision and host.padding is padding
    assert host.placeholders.image_tokens == int((batch["input_ids"] == model.config.image_token_id).sum()) > 0
    ours, n = sft_loss_sum(model, prepared, loss=LossConfig(impl="plain"))
    ours.backward()
    assert n == int(supervised.sum()) and torch.equal(ours, ref)
    our_grads = grads()
    assert our_grads.keys() == ref_grads.keys()
    assert all(torch.equal(our_grads[k], ref_grads[k]) for k in ref_grads)


def _same(a, b) -> bool:
    """Equal values, nested dicts and dataclasses of tensors and ints alike (bit for bit, dtypes included)."""
    import dataclasses

    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_loader_workers_prepare_the_step_inputs(tiny, shapes_dir, packing):
    """The SFT loader's worker process computes the step's host inputs (HostPrep, config values only,
    pickled as a spawned worker gets it): the same as the step computes from a plain batch, and the
    step's loss from them is the same bits."""
    import copy
    import pickle

    import torch

    from vlforge.config import DataConfig, LossConfig
    from vlforge.data.dataset import Batching, load_dataset
    from vlforge.data.encode import collate, pack
    from vlforge.train.inputs import HostPrep, step_inputs
    from vlforge.train.losses import sft_loss_sum
    from vlforge.recipes.sft import micro_batches

    model = copy.deepcopy(tiny[0])  # packed rows switch its attention implementation
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny[1], DataConfig())
    prep = pickle.loads(pickle.dumps(HostPrep.of(model)))  # no model object inside: it pickles small
    assert len(pickle.dumps(prep)) < 100_000
    batching = Batching(3, packed=packing)
    worker = micro_batches(data, batching, seed=0, epoch=0, position=0, num_workers=1, prepare=prep)
    plain = micro_batches(data, batching, seed=0, epoch=0, position=0, num_workers=0)
    for _ in range(2):
        (prepared, _, _), (batch, _, _) = next(worker), next(plain)
        assert "pixel_values" in batch and "host_inputs" in prepared and "host_inputs" not in batch
        assert _same(prepared["host_inputs"], HostPrep.of(model)(batch)["host_inputs"])
        ours, theirs = step_inputs(model, prepared, torch.device("cpu")), step_inputs(model, batch, torch.device("cpu"))
        assert ours.keys() == theirs.keys() and "position_ids" in ours
        assert _same(ours["host"].vision, theirs["host"].vision) and ours["host"].vision
        with torch.no_grad():
            a, n = sft_loss_sum(model, ours, loss=LossConfig(impl="plain"))
            b, m = sft_loss_sum(model, theirs, loss=LossConfig(impl="plain"))
        assert n == m > 0 and torch.equal(a, b)
    # a micro-batch whose rows were all skipped (data.on_error=skip) prepares to nothing (the step drops it)
    empty = (pack if packing else collate)([], data.encoder.pad_id)
    assert prep(empty)["host_inputs"]["supervised"] == 0


def test_prepared_batches_step_with_the_same_syncs_and_loss(shapes_dir, tmp_path):
    """train_step on loader-prepared batches: the same loss bits and vlforge's syncs as on plain ones."""
    import torch

    rows = []
    for prepare in (False, True):
        torch.manual_seed(0)  # the tiny model's trainable init and dropout draw from the global RNG
        (syncs,), row = _step(shapes_dir, tmp_path / str(prepare), packing=True, prepare=prepare)
        rows.append(row)
    assert _ours(syncs) == OURS, syncs.table()
    assert rows[1]["loss"] == rows[0]["loss"] and rows[1]["grad_norm"] == rows[0]["grad_norm"]


if __name__ == "__main__":
    import tempfile

    import torch
    from vlforge.data.synth import synth_shapes

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        shapes = Path(tmp) / "shapes"
        synth_shapes(shapes, 16, seed=0, val_fraction=2 / 16)
        for packing in (False, True):
            (syncs,), _ = _step(shapes, Path(tmp) / f"out{packing}", packing)
            print(f"\n== {'packed' if packing else 'padded'}: 2 micro-batches of 3 samples; {syncs.total()} syncs, "
                  f"{syncs.total(ours_only=True)} in vlforge")
            print(syncs.table())


def test_generation_prefill_reads_no_device_tensor_on_the_host(tiny, shapes_dir):
    """The engine builds a prefill on the host (prompt batch, M-RoPE positions, the vision tower's
    grid inputs, the slots' settings) and queues it to the device: a generate call's own host reads
    are its sync point and the results' harvest, whatever the prompts; transformers' get_rope_index,
    vision grid inputs and per-block vision split (~10 syncs a prompt on a GPU) read host copies."""
    import copy

    from vlforge.config import DataConfig
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import encode_prompt
    from vlforge.generate.engine import Engine
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, Prompt

    model, processor = tiny
    model = copy.deepcopy(model).eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    encoder = data.encoder

    def requests(k):
        prompts = [encode_prompt(encoder, s) for s in data.samples[:k]]
        return [GenRequest(Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw")), n=2,
                           max_new_tokens=3, temperature=1.0) for x in prompts]

    counts = []
    for k in (2, 4):
        with SyncCounter(model, torch.device("cpu")) as syncs:  # the engine's buffers are made inside: seen
            Engine(model, sync_every=4).generate(requests(k), stop_ids=[], banned_ids=vision_token_ids(encoder),
                                                 image_token_id=encoder.image_token_id, pad_id=encoder.pad_id)
        assert syncs.total() > 0  # the counter sees the library's syncs: it can fail
        assert _ours(syncs) == {("cpu", "vlforge/generate/runner.py"): 5}, syncs.table()  # sync point + harvest
        library = {site for (_, site) in syncs.by_site() if not site.startswith("vlforge/")}
        assert not [s for s in library if "get_rope_index" in s or "vision" in s or "listcomp" in s], syncs.table()
        counts.append(syncs.total())
    assert counts[0] == counts[1]  # nothing per prompt


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_grpo_update_forward_reads_no_device_value(tiny, prompts_jsonl, packing):
    """GRPO's log-prob forward (rollout/logprobs.sequence_logprobs: the update's and the KL reference's)
    lays out its rows from the rollout's host copy, made once per rollout: after it, the forward and
    backward of a mini-batch part read no device value of vlforge's, and of transformers' only its
    packed-sequence detection (packed rows); the image and deepstack features are placed by index."""
    import copy
    import dataclasses

    from test_grpo_packing import mixed_rollout
    from vlforge.rollout.logprobs import sequence_logprobs

    model = copy.deepcopy(tiny[0])
    rollout = mixed_rollout(model.eval(), tiny[1], prompts_jsonl)
    model.train()
    assert rollout.host.response_mask is not rollout.response_mask  # the one copy, as the first forward makes it
    syncs = SyncCounter(model, torch.device("cpu"))
    for field in dataclasses.fields(rollout):  # the rollout lives on the device, as the recipe's does
        if isinstance(value := getattr(rollout, field.name), torch.Tensor):
            syncs.device[value] = True
    with syncs:
        logp, entropy = sequence_logprobs(model, rollout, 1.0, with_entropy=True, packing=packing)
        (logp.sum() + 0 * entropy.sum()).backward()
    assert logp.shape == rollout.response_mask.shape and bool((logp != 0).any())
    assert syncs.total(ours_only=True) == 0, syncs.table()
    library = {site.split()[-1] for (_, site) in syncs.by_site() if not site.startswith("vlforge/")}
    assert library == LIBRARY[packing], syncs.table()
