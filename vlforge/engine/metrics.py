"""metrics.jsonl (one JSON object per logged step), optional TensorBoard, and PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsLog:
    def __init__(self, output_dir: str | Path, tensorboard: bool = False, resume_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # A killed run may have logged steps after its last checkpoint: drop them, they will be redone.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("log.tensorboard=true needs the tensorboard package: pip install 'vlforge[tensorboard]'") from e
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def log(self, step: int, values: dict) -> None:
        row = {"step": step, **{k: (float(f"{v:.7g}") if isinstance(v, float) else v) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metric(rows: list[dict], key: str, out_png: str | Path, title: str | None = None,
                marks: list[tuple[int, float]] | None = None, log_y: bool = False) -> Path:
    """Line plot of `key` over `step` (plus optional (step, value) markers, e.g. eval accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["step"], r[key]) for r in rows if key in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if pts:
        ax.plot(*zip(*pts), label=key)
    if marks:
        ax.plot(*zip(*marks), "o", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    if log_y and pts and min(v for _, v in pts) > 0:
        ax.set_yscale("log")
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    if marks:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)


def write_json_atomic(data: dict, path: str | Path) -> None:
    """Write JSON under a temporary name, then rename: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
