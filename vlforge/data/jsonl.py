"""Read and validate JSONL datasets into `Sample`s. Every problem names the file and line.

Two row schemas (image paths are relative to the JSONL file unless absolute):

    {"image": "a.png" | "images": ["a.png", "b.png"], "text" | "prompt": "...", "answer": "..."}
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                               {"type": "text", "text": "..."}]},
                  {"role": "assistant", "content": "..."}]}

Extra keys (e.g. "task") are kept in `Sample.fields` for metrics and reward functions.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A bad dataset row. The message starts with `file:line:` and says what to do."""


@dataclass
class Sample:
    messages: list[dict]  # chat messages; image parts carry an absolute "image" path
    images: list[Path]  # in order of appearance
    source: str  # "file:line", for error messages
    fields: dict = field(default_factory=dict)  # extra row keys (task, ...)

    @property
    def answer(self) -> str:
        """The reference answer: the content of the final assistant message."""
        return _text_of(self.messages[-1]["content"])

    @property
    def prompt_messages(self) -> list[dict]:
        return self.messages[:-1]


@dataclass
class LoadReport:
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    first_errors: list[str] = field(default_factory=list)  # a few full messages, for the user


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _image_path(value, base: Path, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: image must be a non-empty path string, got {value!r}")
    path = Path(value)
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise DataError(f"{where}: image file {path} not found (paths are relative to the JSONL file's folder)")
    try:
        with Image.open(path) as im:  # reads the header only; full decode happens when training
            im.size
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: image {path} cannot be decoded ({e}); re-export it as PNG/JPEG or drop the row") from e
    return path


def _from_simple(row: dict, base: Path, where: str) -> tuple[list[dict], list[Path]]:
    if "image" in row and "images" in row:
        raise DataError(f"{where}: give either 'image' or 'images', not both")
    raw_images = row.get("images", [row["image"]] if "image" in row else [])
    if not isinstance(raw_images, list):
        raise DataError(f"{where}: 'images' must be a list of paths")
    text_key = "text" if "text" in row else "prompt" if "prompt" in row else None
    if text_key is None:
        raise DataError(f"{where}: missing key 'text' (or 'prompt'): the question to ask about the image(s)")
    if "answer" not in row:
        raise DataError(f"{where}: missing key 'answer': the target response")
    text, answer = row[text_key], row["answer"]
    if not isinstance(text, str):
        raise DataError(f"{where}: '{text_key}' must be a string")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer).strip() == "":
        raise DataError(f"{where}: 'answer' is empty or not a string; every row needs a target response")
    images = [_image_path(v, base, where) for v in raw_images]
    user = [{"type": "image", "image": str(p)} for p in images] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": str(answer)}]
    if isinstance(row.get("system"), str):
        messages.insert(0, {"role": "system", "content": row["system"]})
    return messages, images


def _from_chat(row: dict, base: Path, where: str) -> tuple[list[dict], list[Path]]:
    messages, images = [], []
    if not isinstance(row["messages"], list) or not row["messages"]:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, msg in enumerate(row["messages"]):
        at = f"{where}: messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or "content" not in msg:
            raise DataError(f"{at} needs 'role' (one of {', '.join(ROLES)}) and 'content'")
        content = msg["content"]
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    path = _image_path(part.get("image", part.get("path")), base, f"{at}.content[{j}]")
                    images.append(path)
                    parts.append({"type": "image", "image": str(path)})
                elif kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise DataError(f"{at}.content[{j}]: parts must be {{\"type\": \"image\", \"image\": path}} "
                                    f"or {{\"type\": \"text\", \"text\": str}}, got {part!r}")
            content = parts
        elif not isinstance(content, str):
            raise DataError(f"{at}: content must be a string or a list of parts")
        if msg["role"] == "assistant" and any(p["type"] == "image" for p in (content if isinstance(content, list) else [])):
            raise DataError(f"{at}: assistant messages cannot contain images")
        messages.append({"role": msg["role"], "content": content})
    if messages[-1]["role"] != "assistant" or not _text_of(messages[-1]["content"]).strip():
        raise DataError(f"{where}: the last message must be a non-empty assistant answer (the training target)")
    return messages, images


def parse_row(line: str, base: Path, where: str) -> Sample:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object") from e
    if not isinstance(row, dict):
        raise DataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages, images = _from_chat(row, base, where)
        extra = {k: v for k, v in row.items() if k != "messages"}
    else:
        messages, images = _from_simple(row, base, where)
        extra = {k: v for k, v in row.items() if k not in ("image", "images", "text", "prompt", "answer", "system")}
    return Sample(messages=messages, images=images, source=where, fields=extra)


def read_jsonl(path: str | Path, on_error: str = "fail", report: LoadReport | None = None) -> list[Sample]:
    """Parse every row. on_error="fail" raises the first DataError; "skip" counts it in `report`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    report = report if report is not None else LoadReport()
    samples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            report.rows += 1
            try:
                samples.append(parse_row(line, path.parent, f"{path}:{lineno}"))
            except DataError as e:
                if on_error == "fail":
                    raise
                reason = str(e).split(": ", 1)[1].split(" (")[0][:60]
                report.skipped[reason] += 1
                if len(report.first_errors) < 5:
                    report.first_errors.append(str(e))
    report.kept += len(samples)
    return samples
