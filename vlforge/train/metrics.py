"""metrics.jsonl (one JSON object per logged step), optional TensorBoard, and PNG plots."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from vlforge.config import ConfigError


def _rows(path: Path) -> list[tuple[str, dict]]:
    """(line, row) of each JSON object line. A line that is not one (a crash mid-write tears the
    last line; a power loss can leave NUL bytes) is dropped with a warning naming file:line."""
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            print(f"warning: {path}:{number}: dropped a line that is not a JSON object (torn by a crash mid-write?): "
                  f"{line[:60]!r}", file=sys.stderr)
            continue
        rows.append((line, row))
    return rows


class MetricsLog:
    def __init__(self, output_dir: str | Path, tensorboard: bool = False, resume_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        if self.path.exists():
            # A killed run may have logged steps after its last checkpoint: drop them, they will be
            # redone. A torn last line goes too: appending after it would glue the next row onto it.
            kept = [line for line, row in _rows(self.path) if resume_step is None or row.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")  # renamed: a crash now cannot lose the kept rows
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
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


class NullMetrics:
    """MetricsLog's interface, writing nothing: the metrics log of ranks other than 0."""

    def log(self, step: int, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl; torn lines are dropped with a warning."""
    return [row for _, row in _rows(Path(path))]


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


def check_writable(path: str | Path, flag: str) -> None:
    """Fail now, not after the work: `path` (a file to be written later) can be created or replaced."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")
    probe = folder / f".{path.name}.probe-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose another path") from None


def write_json_atomic(data: dict, path: str | Path) -> None:
    """Write JSON under a temporary name, then rename: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
