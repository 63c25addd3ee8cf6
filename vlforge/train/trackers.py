"""wandb and MLflow: the run's scalars and sample tables, beside metrics.jsonl and samples/.

log.wandb: a wandb run (project log.project, name log.run_name), scalars by step, each sample log's
rows as a wandb.Table, their images as wandb.Image (samples/KIND_images, captioned with the names
the rows give). wandb reads WANDB_MODE itself: `offline` writes output_dir/wandb/ with no network
(air-gapped machines; `wandb sync` uploads it later).
log.mlflow: an MLflow run in experiment log.project at log.mlflow_uri (default: a local SQLite
store, output_dir/mlflow.db, artifacts in output_dir/mlartifacts/), scalars as metrics, each sample
log's rows as a JSON artifact (samples/KIND/step_N.json), its thumbnails as artifacts (samples/img/).
Rank 0 only: Run.start builds them where it builds the metrics log.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from vlforge.config import ConfigError, LogConfig

MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"  # log.mlflow's default store, in output_dir


class Trackers:
    """The trackers log.wandb / log.mlflow ask for; `log` and `samples` go to each, `close` ends them."""

    def __init__(self, cfg: LogConfig, out: Path, config: dict):
        self.wandb = self.mlflow = self.mlflow_run = None
        name = cfg.run_name or Path(out).name
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb=true needs the wandb package: pip install 'vlforge[wandb]'") from None
            self.wandb = wandb.init(project=cfg.project, name=name, dir=str(out), config=config, reinit="create_new")
        if cfg.mlflow:
            try:
                from mlflow import MlflowClient
            except ImportError:
                raise ConfigError("log.mlflow=true needs MLflow: pip install 'vlforge[mlflow]'") from None
            for logger in ("mlflow.store.db.utils", "alembic"):  # a new store's set-up notes: not ours to print
                logging.getLogger(logger).setLevel(logging.WARNING)
            # default: a SQLite store in the run directory (MLflow 3 refuses its older file store unless
            # told otherwise), artifacts beside it; a client of its own: no global MLflow state set
            local = Path(out).resolve()
            self.mlflow = MlflowClient(tracking_uri=cfg.mlflow_uri or f"sqlite:///{local / MLFLOW_DB}")
            found = self.mlflow.get_experiment_by_name(cfg.project)
            experiment = found.experiment_id if found else self.mlflow.create_experiment(
                cfg.project, artifact_location=None if cfg.mlflow_uri else (local / MLFLOW_ARTIFACTS).as_uri())
            self.mlflow_run = self.mlflow.create_run(experiment, run_name=name).info.run_id
            self.mlflow.log_dict(self.mlflow_run, config, "config.json")

    def log(self, step: int, row: dict) -> None:
        """The row's finite numbers (lists and strings, e.g. nonfinite_groups, stay in metrics.jsonl)."""
        scalars = {k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   and k != "time_unix"}  # the trackers stamp their own times
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.mlflow.log_batch(self.mlflow_run, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def samples(self, kind: str, rows: list[dict], folder: Path) -> None:
        """One sample log's new rows (train/samples.py), `folder` holding their img/ thumbnails."""
        if not rows:
            return
        step = rows[0]["step"]
        if self.wandb is not None:
            import wandb

            # the images beside the table, captioned with the names its rows give: wandb (0.31) writes
            # no image that sits in a table cell of an offline run
            columns = sorted({k for r in rows for k in r})
            logged = {f"samples/{kind}": wandb.Table(columns=columns,
                                                     data=[[_cell(r.get(c)) for c in columns] for r in rows])}
            if images := sorted({p for r in rows for p in _images(r)}):
                logged[f"samples/{kind}_images"] = [wandb.Image(str(folder / p), caption=p) for p in images]
            self.wandb.log(logged, step=step)
        if self.mlflow is not None:
            self.mlflow.log_dict(self.mlflow_run, rows, f"samples/{kind}/step_{step:06d}.json")
            for image in sorted({p for r in rows for p in _images(r)}):
                self.mlflow.log_artifact(self.mlflow_run, str(folder / image), "samples/img")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.mlflow_run)


def _cell(value):
    """A table cell: numbers and text as they are, nested values (responses, rewards) as JSON text."""
    import json

    return value if value is None or isinstance(value, (int, float, str, bool)) else json.dumps(value)


def _images(row: dict) -> list[str]:
    """Every thumbnail a row names: the prompt's and the tool results' (GRPO responses' turns)."""
    names = list(row.get("images", []))
    for response in row.get("responses", []):
        for turn in response.get("turns", []):
            names += turn.get("images", [])
    return names


class TrackedMetrics:
    """A metrics log that also sends its rows to the trackers (MetricsLog's interface)."""

    def __init__(self, metrics, trackers: Trackers):
        self.metrics, self.trackers = metrics, trackers

    def log(self, step: int, values: dict) -> None:
        self.metrics.log(step, values)
        self.trackers.log(step, values)

    def close(self) -> None:
        self.metrics.close()
        self.trackers.close()
