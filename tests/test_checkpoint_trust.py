"""What a resume trusts in a checkpoint: nothing unpickled (a planted object never runs), the model it
was trained from (another base refused, naming both), its shapes (a changed LoRA rank named before
loading), its files (a manifest of sizes and checksums: a damaged checkpoint skipped by resume=auto,
refused by resume=PATH), and what overwrite and rotation may remove (only what the manifest lists)."""

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import ConfigError, ModelConfig
from vlforge.train import runtime
from vlforge.train.checkpoint import space_problem
from vlforge.train.manifest import MANIFEST, write_manifest
from vlforge.train.rng import restore_rng, rng_state, save_rng
from vlforge.train.runtime import prepare_output_dir, release_output_dir
from vlforge.model.load import load_model
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

QUIET = ["eval.every=0", "data.val=null"]


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    for path in list(runtime._HELD):
        release_output_dir(path)


class Planted:
    """An object whose unpickling writes `marker`: what a hostile checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".vlforge.lock"))
    return dst


# ----------------------------------------------------------------------------- nothing unpickled


def test_rng_files_hold_only_tensors_and_numbers_and_restore_the_streams(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    save_rng(tmp_path / "rng.pt")
    expected = (torch.rand(4), [random.random() for _ in range(4)])
    saved = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert isinstance(saved["python"], torch.Tensor) and saved["python"].dtype == torch.int64
    torch.manual_seed(99)
    random.seed(99)
    assert restore_rng(tmp_path, rank=0, seed=0, step=1)
    assert torch.equal(torch.rand(4), expected[0]) and [random.random() for _ in range(4)] == expected[1]


def test_a_pickle_planted_in_a_checkpoint_never_runs(shapes_dir, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["tiers.method=lora", "train.save_every=1", *QUIET]
    run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=1"))
    ckpt, marker = out / "checkpoint-1", tmp_path / "ran"
    # a hostile checkpoint is consistent: its manifest lists the planted files' own checksums
    torch.save({**rng_state(), "payload": Planted(marker)}, ckpt / "rng.pt")
    write_manifest(ckpt)
    capsys.readouterr()
    run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=2", "train.resume=auto"))
    printed = capsys.readouterr().out
    assert not marker.exists()
    assert f"resumed from {ckpt} at step 1" in printed
    assert f"{ckpt / 'rng.pt'} holds objects other than tensors and numbers (exec)" in printed
    assert "starts a fresh stream" in printed and (out / "checkpoint-2" / MANIFEST).is_file()

    good = torch.load(ckpt / "optimizer.pt", weights_only=True)
    torch.save({**good, "payload": Planted(marker)}, ckpt / "optimizer.pt")
    write_manifest(ckpt)
    with pytest.raises(ConfigError, match=r"optimizer\.pt holds objects other than tensors and numbers "
                                          r"\(exec\): vlforge never unpickles them"):
        run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=2", f"train.resume={ckpt}"))
    assert not marker.exists()
    torch.load(ckpt / "optimizer.pt", weights_only=False)  # the plant is live: plain unpickling runs it
    assert marker.read_text() == "ran"


def test_a_sharded_checkpoint_is_read_without_unpickling(tmp_path):
    """DCP's own reader unpickles its .metadata and its planner each non-tensor item: both run a
    planted object. model/safe_load's reader and planner refuse them."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from vlforge.model.safe_load import ForeignObjects, SafeLoadPlanner, SafeReader, read_metadata

    marker = tmp_path / "ran"
    dcp.save({"w": torch.zeros(2), "lr": Planted(marker)}, checkpoint_id=str(tmp_path / "dcp"))
    assert not marker.exists()
    state = {"w": torch.ones(2), "lr": None}
    with pytest.raises(BaseException, match="Weights only load failed"):  # DCP's CheckpointException
        dcp.load(state, storage_reader=SafeReader(str(tmp_path / "dcp")), planner=SafeLoadPlanner())
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))  # DCP's default planner
    assert marker.exists()
    marker.unlink()

    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ForeignObjects, match=r"dcp/\.metadata holds objects other than DCP's records .*exec"):
        read_metadata(tmp_path / "dcp")
    assert not marker.exists()
    with pytest.raises(AttributeError):  # DCP's own reader runs it, then finds no Metadata in what it returned
        dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert marker.exists()


def test_export_of_a_sharded_checkpoint_never_unpickles_its_metadata(shapes_dir, tmp_path):
    """`vlforge export` takes a checkpoint a user hands it: a sharded one exports (LoRA merged) through
    model/safe_load's reader, and one whose DCP metadata holds a planted object is refused unrun."""
    import pickle

    from vlforge.model.export import export
    from vlforge.model.safe_load import ForeignObjects

    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "tiers.method=lora", *QUIET, "train.max_steps=1",
                            "distributed.strategy=fsdp2"))
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert export(ckpt, tmp_path / "merged", merge=True)["kind"] == "consolidated"
    marker = tmp_path / "ran"
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ForeignObjects, match=r"\.metadata holds objects other than DCP's records"):
        export(ckpt, tmp_path / "again", merge=True)
    assert not marker.exists()


# ----------------------------------------------------------------------------- the model it was trained from


def test_resuming_onto_another_base_model_is_refused_naming_both(shapes_dir, tmp_path):
    out = tmp_path / "lora"
    common = ["tiers.method=lora", "train.save_every=1", *QUIET]
    run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=1"))
    saved_with = (out / "config.yaml").read_text()
    again = lambda *extra: run_sft(tiny_sft_config(shapes_dir, out, *common, "train.max_steps=2",  # noqa: E731
                                                   "train.resume=auto", *extra))
    with pytest.raises(ConfigError, match=r"trained from model\.preset=tiny \(model\.seed=0\) \(qwen3_vl: .*this run's "
                                          r"model is model\.preset=tiny-moe \(model\.seed=0\) \(qwen3_vl_moe: .*another "
                                          r"architecture"):
        again("model.preset=tiny-moe")
    with pytest.raises(ConfigError, match=r"model\.seed=0\).*this run's model is model\.preset=tiny \(model\.seed=1\)"
                                          r".*another base model"):
        again("model.seed=1")
    assert (out / "config.yaml").read_text() == saved_with and not (out / "checkpoint-2").exists()

    # a full fine-tuning checkpoint brings every weight: another seed of the same architecture resumes
    full = tmp_path / "full"
    run_sft(tiny_sft_config(shapes_dir, full, "tiers.method=full", "train.save_every=1", *QUIET, "train.max_steps=1"))
    run_sft(tiny_sft_config(shapes_dir, full, "tiers.method=full", *QUIET, "train.max_steps=2", "train.resume=auto",
                            "model.seed=1"))
    assert (full / "checkpoint-2").is_dir()
    with pytest.raises(ConfigError, match=r"another architecture"):
        run_sft(tiny_sft_config(shapes_dir, full, "tiers.method=full", *QUIET, "train.max_steps=3",
                                "train.resume=auto", "model.preset=tiny-moe"))


def test_a_lora_base_from_model_path_is_known_by_its_weights(shapes_dir, tmp_path):
    for name, seed in (("base", 0), ("other", 1)):
        model, processor = load_model(ModelConfig(preset="tiny", seed=seed))
        model.save_pretrained(tmp_path / name)
        processor.save_pretrained(tmp_path / name)
    out = tmp_path / "run"
    common = ["tiers.method=lora", "train.save_every=1", *QUIET]
    run_sft(tiny_sft_config(shapes_dir, out, *common, f"model.path={tmp_path / 'base'}", "train.max_steps=1"))
    with pytest.raises(ConfigError, match=rf"trained from model\.path={tmp_path / 'base'} .*this run's model is "
                                          rf"model\.path={tmp_path / 'other'} .*its weight files differ"):
        run_sft(tiny_sft_config(shapes_dir, out, *common, f"model.path={tmp_path / 'other'}", "train.max_steps=2",
                                "train.resume=auto"))
    shutil.move(tmp_path / "base", tmp_path / "moved")  # the same weights elsewhere: the same base
    run_sft(tiny_sft_config(shapes_dir, out, *common, f"model.path={tmp_path / 'moved'}", "train.max_steps=2",
                            "train.resume=auto"))
    assert (out / "checkpoint-2").is_dir()


@pytest.mark.parametrize("strategy", ["none", "fsdp2"])  # fsdp2: one process, DCP's sharded checkpoint
def test_a_changed_lora_rank_is_refused_before_loading_naming_the_key(shapes_dir, tmp_path, strategy):
    common = ["tiers.method=lora", *QUIET, f"distributed.strategy={strategy}"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path, *common, "train.max_steps=1"))
    with pytest.raises(ConfigError, match=r"cannot resume from .*checkpoint-1: \S*language_model\.layers\.0\.\S*"
                                          r"\.lora_A(\.default)?\.weight is \[8, 64\] there and \[16, 64\] in this "
                                          r"run's model: a LoRA rank differs \(tiers\.\*\.r\)"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path, *common, "tiers.language.r=16", "train.max_steps=2",
                                "train.resume=auto"))
    listed = json.loads((tmp_path / "checkpoint-1" / MANIFEST).read_text())["files"]
    files = {"dcp/.metadata", "dcp/__0_0.distcp", "rng-0.pt"} if strategy == "fsdp2" else \
        {"adapter_model.safetensors", "optimizer.pt", "rng.pt"}
    assert files | {"trainer_state.json", "scheduler.pt"} <= listed.keys()  # every file, the shards included


# ----------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(shapes_dir, tmp_path_factory):
    """A full fine-tuning run's checkpoint-1 and checkpoint-2, and an uninterrupted 3-step run."""
    root = tmp_path_factory.mktemp("trust")
    common = ["tiers.method=full", "train.save_every=1", "optim.schedule=constant", *QUIET]
    run_sft(tiny_sft_config(shapes_dir, root / "run", *common, "train.max_steps=2"))
    run_sft(tiny_sft_config(shapes_dir, root / "straight", *common, "train.max_steps=3"))
    return root, lambda out, *extra: tiny_sft_config(shapes_dir, out, *common, *extra)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, damage", [("model.safetensors", _truncate), ("optimizer.pt", _truncate),
                                          ("scheduler.pt", _truncate), ("rng.pt", _truncate),
                                          ("trainer_state.json", _truncate), ("optimizer.pt", _flip_a_byte)],
                         ids=["model", "optimizer", "scheduler", "rng", "trainer_state", "optimizer-same-size"])
def test_resume_auto_skips_a_damaged_checkpoint_for_the_newest_intact_one(two_checkpoints, tmp_path, capsys, name,
                                                                         damage):
    root, config = two_checkpoints
    out = _copy(root / "run", tmp_path / "run")
    damage(out / "checkpoint-2" / name)
    capsys.readouterr()
    run_sft(config(out, "train.max_steps=3", "train.resume=auto"))
    printed = capsys.readouterr().out
    why = "sha256 is not its manifest's" if damage is _flip_a_byte else "bytes, its manifest says"
    assert f"skipping {out / 'checkpoint-2'}, which is damaged: {name}" in printed and why in printed
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in printed
    aside = list(out.glob("superseded-1-*/checkpoint-2"))  # kept, out of rotation's and resume's way
    assert len(aside) == 1 and (aside[0] / name).is_file()
    a = load_file(out / "checkpoint-3" / "model.safetensors")
    b = load_file(root / "straight" / "checkpoint-3" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resumed exactly from checkpoint-1


def test_resume_path_to_a_damaged_checkpoint_is_refused_naming_the_file(two_checkpoints, tmp_path):
    root, _ = two_checkpoints
    out = _copy(root / "run", tmp_path / "run")
    _truncate(out / "checkpoint-2" / "optimizer.pt")
    listing = lambda: sorted(p.name for p in out.iterdir() if p.name != runtime.LOCK_NAME)  # noqa: E731
    before = listing()
    with pytest.raises(ConfigError, match=rf"train\.resume={out / 'checkpoint-2'}: the checkpoint is damaged: "
                                          r"optimizer\.pt is [\d,]+ bytes, its manifest says [\d,]+ \(truncated"):
        prepare_output_dir(out, str(out / "checkpoint-2"), overwrite=False)
    _flip_a_byte(out / "checkpoint-1" / "scheduler.pt")
    with pytest.raises(ConfigError, match=r"damaged: scheduler\.pt's sha256 is not its manifest's"):
        prepare_output_dir(out, str(out / "checkpoint-1"), overwrite=False)
    with pytest.raises(ConfigError, match=r"resume=auto: every checkpoint in .* is damaged \(checkpoint-1/, "
                                          r"checkpoint-2/"):
        prepare_output_dir(out, "auto", overwrite=False)
    assert listing() == before  # nothing moved or removed


def test_a_checkpoint_from_before_manifests_and_identities_still_resumes(two_checkpoints, tmp_path, capsys):
    root, config = two_checkpoints
    out = _copy(root / "run", tmp_path / "run")
    for ckpt in out.glob("checkpoint-*"):  # as vlforge wrote them before this change
        (ckpt / MANIFEST).unlink()
        state = json.loads((ckpt / "trainer_state.json").read_text())
        del state["model_identity"]
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    run_sft(config(out, "train.max_steps=3", "train.resume=auto"))
    printed = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in printed
    assert f"note: {out / 'checkpoint-2'} has no {MANIFEST}" in printed and "records no model identity" in printed
    assert (out / "checkpoint-3" / MANIFEST).is_file()


# ----------------------------------------------------------------------------- what a run may remove


def test_overwrite_and_rotation_remove_only_what_the_run_wrote(two_checkpoints, tmp_path):
    root, config = two_checkpoints
    out = _copy(root / "run", tmp_path / "run")
    (out / "checkpoint-999").mkdir()
    (out / "checkpoint-999" / "notes.txt").write_text("mine")  # a user's folder that only has the name
    with pytest.raises(ConfigError, match=r"overwrite=true removes only what a vlforge run wrote.*also holds "
                                          r"checkpoint-999/; .*\(nothing was removed\)"):
        prepare_output_dir(out, "never", overwrite=True)
    release_output_dir(out)
    shutil.move(out / "checkpoint-999", tmp_path / "kept")
    (out / "checkpoint-1" / "notes.txt").write_text("mine")  # a user's file inside a run's checkpoint
    with pytest.raises(ConfigError, match=r"also holds checkpoint-1/"):
        prepare_output_dir(out, "never", overwrite=True)
    release_output_dir(out)
    assert (out / "checkpoint-1" / "notes.txt").read_text() == "mine"

    # resume=auto passes over the user's folders (no checkpoint in them), keep_last's rotation removes
    # the run's own checkpoints only (checkpoint-1 now holds the user's notes too), and a save whose
    # name a user's folder has sets that folder aside
    shutil.move(tmp_path / "kept", out / "checkpoint-999")
    for name in ("checkpoint-0", "checkpoint-3"):
        (out / name).mkdir()
        (out / name / "data.txt").write_text(f"mine: {name}")
    run_sft(config(out, "train.max_steps=3", "train.resume=auto", "train.keep_last=1"))
    named = sorted(p.name for p in out.iterdir() if re.fullmatch(r"checkpoint-\d+", p.name))
    assert named == ["checkpoint-0", "checkpoint-1", "checkpoint-3", "checkpoint-999"]
    assert (out / "checkpoint-999" / "notes.txt").read_text() == "mine" and (out / "checkpoint-3" / MANIFEST).is_file()
    assert (out / "checkpoint-0" / "data.txt").read_text() == "mine: checkpoint-0"
    assert (out / "checkpoint-1" / "notes.txt").read_text() == "mine"
    [aside] = out.glob("checkpoint-3.not-written-by-vlforge-*")
    assert (aside / "data.txt").read_text() == "mine: checkpoint-3"

    for p in (out / "checkpoint-999", out / "checkpoint-0", aside, out / "checkpoint-1" / "notes.txt"):
        shutil.move(p, tmp_path / p.name)
    assert prepare_output_dir(out, "never", overwrite=True) is None  # all the run's own: all removed
    assert [p.name for p in out.iterdir()] == [runtime.LOCK_NAME]


def test_the_space_warning_reads_small_sizes_in_mb_and_kb(tmp_path):
    warn = space_problem(free=1500, per_checkpoint=5_200_000, held=3, out=tmp_path)
    assert "has 1.5 kB free" in warn and "~5.2 MB each" in warn and "~15.6 MB" in warn and "0.0 GB" not in warn
    assert "~2.0 GB each" in space_problem(free=0, per_checkpoint=2 * 10**9, held=1, out=tmp_path)
