"""Dataset files as rows read by index: JSONL (an offset index), a JSON array (LLaVA's `.json`),
parquet files or a folder of parquet shards (row groups), a `datasets` `save_to_disk` folder (its
Arrow files, memory-mapped). A source turns only the rows asked for into Python objects, so a
million-row set with embedded images opens without reading them (`RowSource.materialised` counts).

Parquet and Arrow are read with pyarrow (`pip install 'vlforge[datasets]'`), never through
`datasets.load_dataset`: nothing here can reach the Hub or any network.
"""

from __future__ import annotations

import bisect
import functools
import json
from array import array
from collections import OrderedDict
from pathlib import Path

from vlforge.config import DataConfig
from vlforge.data.inline import DataError
from vlforge.data.inline import MAX_IMAGE_PIXELS, path_problem
from vlforge.data.jsonl import LoadReport, Sample, _text_line, parse_obj

FORMATS = ("jsonl", "json", "parquet", "arrow")
PREFLIGHT_ROWS = 16  # the rows of a streamed set a run's pre-flight reads


class RowSource:
    """Rows of one dataset by index. `row(i)` -> (where, row): "file:line" or "file:row k" and the
    row as the file holds it (a dict, or anything else for parse_obj to refuse by name).
    `blocks`: the starts of the groups a reader reads whole (parquet row groups) plus the total, for
    a shuffle that keeps reads local; None where any row is as cheap as any other."""

    blocks: list[int] | None = None

    def __init__(self, path: Path, base: Path):
        self.path, self.base, self.materialised = path, base, 0

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, i: int) -> tuple[str, object]:
        raise NotImplementedError

    def __getstate__(self):  # DataLoader workers: open handles and caches are reopened, never pickled
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class JsonlSource(RowSource):
    """A JSONL file: one pass records each non-blank line's offset and number (8 + 4 bytes a row)."""

    def __init__(self, path: Path):
        super().__init__(path, path.parent)
        self.offsets, self.lines = array("q"), array("I")
        with open(path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    self.offsets.append(offset)
                    self.lines.append(lineno)
                offset += len(raw)

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, i: int) -> tuple[str, object]:
        if getattr(self, "_file", None) is None:
            self._file = open(self.path, "rb")
        self._file.seek(self.offsets[i])
        where = f"{self.path}:{self.lines[i]}"
        line = _text_line(self._file.readline(), where, first=self.lines[i] == 1)
        self.materialised += 1
        try:
            return where, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line must be one "
                            "JSON object") from e


class JsonSource(RowSource):
    """A JSON file holding one array of rows (LLaVA's and LLaMA-Factory's `.json`), read whole: a set
    to stream is better written as JSONL (`vlforge data convert`)."""

    def __init__(self, path: Path, rows: list):
        super().__init__(path, path.parent)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> tuple[str, object]:
        self.materialised += 1
        return f"{self.path}:row {i}", self.rows[i]


def _pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading parquet or a `datasets` folder needs pyarrow: "
                        "pip install 'vlforge[datasets]'") from None
    return pyarrow


class TableSource(RowSource):
    """Parquet files (row groups read whole, the last `window` kept) or Arrow IPC files (memory-mapped:
    the OS pages in what a row needs). Rows are numbered from 0 in each file ("file:row k")."""

    def __init__(self, path: Path, files: list[Path], kind: str, window: int):
        super().__init__(path, path if path.is_dir() else path.parent)
        pa = _pyarrow(path)
        self.files, self.kind, self.window = files, kind, window
        self.starts, self.file_of = [0], []  # a group's first global row; the file each group is in
        for k, f in enumerate(files):
            try:
                sizes = ([pa.parquet.ParquetFile(f).metadata.row_group(g).num_rows
                          for g in range(pa.parquet.ParquetFile(f).metadata.num_row_groups)]
                         if kind == "parquet" else [self._arrow(k).num_rows])
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{f}: cannot be read as {kind} ({e}); is it a {kind} file?") from None
            for n in sizes:
                self.starts.append(self.starts[-1] + n)
                self.file_of.append(k)
        self.blocks = self.starts if kind == "parquet" else None
        self.groups_read = 0  # parquet row groups decoded so far (a shuffle's locality shows here)

    def _arrow(self, k: int):
        tables = self.__dict__.setdefault("_tables", {})
        if k not in tables:
            pa = _pyarrow(self.path)
            tables[k] = pa.ipc.open_stream(pa.memory_map(str(self.files[k]))).read_all()
        return tables[k]

    def __len__(self) -> int:
        return self.starts[-1]

    def _group(self, g: int):
        cache = self.__dict__.setdefault("_cache", OrderedDict())
        if g not in cache:
            if self.kind == "parquet":
                pa = _pyarrow(self.path)
                parquet = self.__dict__.setdefault("_parquet", {})
                k = self.file_of[g]
                if k not in parquet:
                    parquet[k] = pa.parquet.ParquetFile(self.files[k])
                cache[g] = parquet[k].read_row_group(g - self.file_of.index(k))
                self.groups_read += 1
            else:
                cache[g] = self._arrow(self.file_of[g])
            while len(cache) > self.window:
                cache.popitem(last=False)
        cache.move_to_end(g)
        return cache[g]

    def row(self, i: int) -> tuple[str, object]:
        g = bisect.bisect_right(self.starts, i) - 1
        k = self.file_of[g]
        in_file = i - self.starts[self.file_of.index(k)]
        self.materialised += 1
        return f"{self.files[k]}:row {in_file}", self._group(g).slice(i - self.starts[g], 1).to_pylist()[0]


def _arrow_folder(path: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in its state.json's order."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{path}: a DatasetDict folder of splits ({', '.join(splits)}): point data.train / "
                        f"data.val at one of them, e.g. {path / (splits[0] if splits else 'train')}")
    try:
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}/state.json cannot be read ({e}); is this a `datasets` save_to_disk folder?") from None


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "arrow"
        if any(path.rglob("*.parquet")):
            return "parquet"
        raise DataError(f"{path}: a folder with neither a `datasets` save_to_disk layout (state.json) nor parquet "
                        "files; give a .jsonl / .json / .parquet file or such a folder (data.format)")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".arrow":
        return "arrow"
    return "json" if suffix == ".json" else "jsonl"


def open_source(path: str | Path, fmt: str = "auto", window: int = 8) -> RowSource:
    """The rows of `path` (a file or a folder) in `fmt` (auto: by the path)."""
    path = Path(path)
    problem = None if path.is_dir() else path_problem(path)
    if problem:
        raise DataError(f"{path}: dataset file {problem}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8-sig"))
        except UnicodeDecodeError:
            raise DataError(f"{path}: not valid UTF-8; re-export the file as UTF-8") from None
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # one object a line: JSON Lines named .json
                return JsonlSource(path)
            raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json dataset is one array of rows ([{{...}}, ...]), got "
                            f"{type(rows).__name__}; or write one row a line (.jsonl)")
        return JsonSource(path, rows)
    if fmt == "jsonl":
        if path.is_dir():
            raise DataError(f"{path} is a directory; data.format=jsonl reads one file")
        return JsonlSource(path)
    if fmt == "parquet":
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        return TableSource(path, files, "parquet", window)
    files = _arrow_folder(path) if path.is_dir() else [path]
    return TableSource(path, files, "arrow", window)


class LazySamples:
    """A source's rows as Samples, each parsed (and its images checked from their headers) when
    indexed: a streaming dataset's `samples`. Raises the row's DataError."""

    def __init__(self, source: RowSource, cfg: DataConfig, decode_images: bool = False):
        self.source = source
        self.parse = functools.partial(parse_obj, base=source.base, max_image_pixels=cfg.max_image_pixels,
                                       decode_images=decode_images, columns=cfg.columns)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        where, row = self.source.row(i)
        return self.parse(row, where=where)


def iter_samples(path: str | Path, cfg: DataConfig, on_error: str = "fail", report: LoadReport | None = None,
                 decode_images: bool = False, limit: int | None = None):
    """Every row of `path` (any format) as a Sample, one at a time (data check holds none of them);
    on_error="fail" raises the first DataError, "skip" counts it in `report`. `limit`: only the
    first rows (a pre-flight of a streamed set)."""
    source = open_source(path, cfg.format, cfg.stream_window)
    if len(source) == 0:
        raise DataError(f"{path}: has no rows (the file is empty or holds only blank lines)")
    report = report if report is not None else LoadReport()
    samples = LazySamples(source, cfg, decode_images)
    n = min(len(source), limit or len(source))
    report.rows += n
    for i in range(n):
        try:
            sample = samples[i]
        except DataError as e:
            if on_error == "fail":
                raise
            report.skip(e)
            continue
        report.kept += 1
        yield sample


def read_samples(path: str | Path, cfg: DataConfig, on_error: str = "fail", report: LoadReport | None = None,
                 decode_images: bool = False, limit: int | None = None) -> list[Sample]:
    """`iter_samples` as a list."""
    return list(iter_samples(path, cfg, on_error, report, decode_images, limit))


def check_readable(path: str | Path, on_error: str = "fail", max_image_pixels: int = MAX_IMAGE_PIXELS,
                   cfg: DataConfig | None = None) -> LoadReport:
    """Pre-flight for recipes, before a model is loaded: the dataset exists, is readable in its format,
    has a usable row, and every image opens (headers only; nothing is decoded or tokenized). A
    streamed data.train (cfg.stream): its first rows only, the rest are checked as they are read."""
    cfg = cfg or DataConfig(on_error=on_error, max_image_pixels=max_image_pixels)
    report = LoadReport()
    streamed = cfg.stream and str(path) == str(cfg.train)
    read_samples(path, cfg, on_error, report, limit=PREFLIGHT_ROWS if streamed else None)
    if not report.kept:
        raise DataError(f"{path}: no usable rows ({report.rows} read, skipped: {dict(report.skipped)}); "
                        f"see `vlforge data check {path}`")
    return report
