"""`vlforge data convert IN OUT`: any dataset vlforge reads (data/sources.py, data/layouts.py) as
native JSONL `messages` rows, embedded images written as files beside it, for users who want to
inspect or edit their data. Each row is read and checked as training reads it (the same errors)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


from vlforge.config import DataConfig
from vlforge.data.inline import DataError, ImageBytes
from vlforge.data.jsonl import LoadReport, Sample, open_image
from vlforge.data.video import Video
from vlforge.data.sources import LazySamples, open_source


def _image_file(image: ImageBytes, folder: Path) -> Path:
    """An embedded image as a file named by its content (the same bytes are written once), in the
    format its bytes are in."""
    with open_image(image) as im:
        fmt = (im.format or "PNG").lower()
    ext = {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt)
    path = folder / f"{hashlib.sha256(image.data).hexdigest()[:16]}.{ext}"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(image.data)
        os.replace(tmp, path)
    return path


def _rel(path, out_dir: Path) -> str:
    return os.path.relpath(Path(path).resolve(), out_dir.resolve())


def _part(part: dict, out_dir: Path, images_dir: Path) -> dict:
    if part["type"] == "image":
        image = part["image"]
        path = _image_file(image, images_dir) if isinstance(image, ImageBytes) else Path(image)
        return {"type": "image", "image": _rel(path, out_dir)}
    if part["type"] == "video":
        video: Video = part["video"]
        if isinstance(video.source, bytes):
            raise DataError("an inline video cannot be written (only files and frame lists)")
        if video.is_file:
            return {"type": "video", "video": _rel(video.source, out_dir)}
        return {"type": "video", "video": [_rel(p, out_dir) for p in video.source], "fps": video.fps}
    return dict(part)


def native_row(sample: Sample, out_dir: Path, images_dir: Path) -> dict:
    """A Sample as a native `messages` row whose paths are relative to `out_dir`."""
    messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else [_part(p, out_dir, images_dir) for p in m["content"]]} for m in sample.messages]
    row = {"messages": messages, **({"tools": sample.tools} if sample.tools else {})}
    return {**row, **{k: v for k, v in sample.fields.items() if k not in row}}


def convert(src: str | Path, out: str | Path, cfg: DataConfig, on_error: str = "fail") -> LoadReport:
    """Write every row of `src` to `out` (JSONL) and its embedded images under `<out stem>-images/`.
    Refuses to write over an existing `out`; a bad row stops the conversion (on_error=fail, `out`
    left unwritten) or is counted and left out (skip)."""
    out = Path(out)
    if out.exists():
        raise DataError(f"{out} exists; give a new file name (nothing is overwritten)")
    if out.suffix != ".jsonl":
        raise DataError(f"{out}: the output is a JSONL file: give a name ending in .jsonl")
    source = open_source(src, cfg.format, cfg.stream_window)
    samples = LazySamples(source, cfg)
    images_dir = out.parent / f"{out.stem}-images"
    report = LoadReport()
    tmp = out.with_name(f".{out.name}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(len(samples)):
                report.rows += 1
                try:
                    row = native_row(samples[i], out.parent, images_dir)
                except DataError as e:
                    if on_error == "fail":
                        raise
                    report.skip(e)
                    continue
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                report.kept += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return report


__all__ = ["convert", "native_row"]
