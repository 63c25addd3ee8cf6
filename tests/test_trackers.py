"""log.wandb (offline) and log.mlflow (its default local store: SQLite in the run directory) on a tiny SFT run with evaluation: the
metrics' scalars and the eval sample table reach each tracker, read back from what it wrote."""

import json
from pathlib import Path

import pytest
from helpers import tiny_sft_config

from vlforge.train.metrics import read_metrics
from vlforge.train.samples import read_samples


def test_mlflow_local_store_holds_the_scalars_and_the_sample_table(shapes_dir, tmp_path):
    pytest.importorskip("mlflow", reason="pip install 'vlforge[mlflow]' (in the test extra)")
    from mlflow import MlflowClient

    from vlforge.recipes.sft import run_sft

    out = tmp_path / "run"
    run_sft(tiny_sft_config(shapes_dir, out, "eval.every=1", "log.samples_eval=2", "log.mlflow=true",
                            "log.project=issue46", "log.run_name=tiny-sft"))
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("issue46").experiment_id])
    assert run.info.run_name == "tiny-sft" and run.info.status == "FINISHED"
    rows = read_metrics(out / "metrics.jsonl")
    for key in ("loss", "grad_norm", "lr", "eval_accuracy", "eval_loss"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    assert "time_unix" not in run.data.metrics  # the trackers keep their own times
    probes = read_samples(out, "eval")
    for step in (1, 2):
        path = client.download_artifacts(run.info.run_id, f"samples/eval/step_{step:06d}.json", str(tmp_path / "dl"))
        assert json.loads(Path(path).read_text()) == [p for p in probes if p["step"] == step]
    images = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(run.info.run_id, "samples/img")}
    assert images == {name.removeprefix("img/") for p in probes for name in p["images"]}


def wandb_history(path) -> list:
    """The history records of an offline run's .wandb file: wandb's own protobuf Records, in the
    LevelDB log framing wandb writes them in (a 7-byte ":W&B" header; 32 KiB blocks of records, each
    checksum, length, type; a record cut across blocks as FIRST, MIDDLE.., LAST). wandb has no reader
    of its own for an offline run (`wandb sync` uploads it)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = Record.FromString(buf)
            buf = b""
            if record.HasField("history"):
                out.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return out


def test_wandb_offline_run_holds_the_scalars_and_the_sample_table(shapes_dir, tmp_path, monkeypatch):
    """WANDB_MODE=offline: the run's history (read from its .wandb file) holds every metrics row's
    scalars at its step, and the eval sample table (its rows, and the images named in them)."""
    pytest.importorskip("wandb", reason="pip install 'vlforge[wandb]' (in the test extra)")
    from vlforge.recipes.sft import run_sft

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_sft(tiny_sft_config(shapes_dir, out, "eval.every=1", "log.samples_eval=2", "log.wandb=true",
                            "log.project=issue46"))
    [run_dir] = list((out / "wandb").glob("offline-run-*"))
    history = wandb_history(next(run_dir.glob("run-*.wandb")))
    rows = read_metrics(out / "metrics.jsonl")
    by_step: dict = {}  # wandb writes one history row per step: the train row's, the eval's, the table
    for h in history:
        by_step.setdefault(h["_step"], {}).update(h)
    scalars = [(row["step"], k, v) for row in rows for k, v in row.items() if k not in ("step", "time_unix")
               and isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert {k for _, k, _ in scalars} >= {"loss", "grad_norm", "lr", "eval_loss", "eval_accuracy"}
    for step, key, value in scalars:
        assert by_step[step][key] == pytest.approx(value, rel=1e-6), key
    assert not any("time_unix" in h for h in history)  # the trackers keep their own times
    probes = read_samples(out, "eval")
    for step in (1, 2):
        logged = by_step[step]
        table = json.loads((run_dir / "files" / logged["samples/eval/path"]).read_text())
        column = {c: i for i, c in enumerate(table["columns"])}
        mine = [p for p in probes if p["step"] == step]
        assert [r[column["answer"]] for r in table["data"]] == [p["answer"] for p in mine]
        assert [r[column["correct"]] for r in table["data"]] == [p["correct"] for p in mine]
        # (wandb's history flattens a logged value's fields into KEY/FIELD)
        assert logged["samples/eval_images/_type"] == "images/separated"
        assert logged["samples/eval_images/captions"] == sorted({n for p in mine for n in p["images"]})
        assert all((run_dir / "files" / f).is_file() for f in logged["samples/eval_images/filenames"])
