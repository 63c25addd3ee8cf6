"""Other tools' row layouts, read into vlforge's own (a simple row or a `messages` row), before
`jsonl.parse_obj` validates them. Nothing here opens a file; each conversion is exact or an error:

- `data.columns` ({our key: their column}) renames a set's columns first (`problem` -> `prompt`);
- ShareGPT / LLaVA (LLaMA-Factory, ms-swift): `{"conversations": [{"from": "human", "value":
  "<image>\\n..."}, {"from": "gpt", ...}], "images": [...], "system": ...}`: roles mapped, the
  system prompt kept, each `<image>` / `<video>` bound to the row's next image / video, in order;
- a `messages` row with top-level `images` / `videos` (ms-swift, LLaMA-Factory's OpenAI style), and
  a simple row whose text holds placeholders (verl / EasyR1 RL sets: `"<image>Find x."`): the same
  binding. Placeholder and image counts must be equal: anything else is ambiguous, and refused;
- OpenAI chat parts `{"type": "image_url", "image_url": {"url": ...}}` (`vlforge serve`'s requests,
  logged API traffic): a data URL becomes an embedded image, a local path or file:// URL must lie
  inside the dataset's folder, a remote URL is refused (nothing is downloaded);
- embedded images (`datasets`' Image feature, `{"bytes": ..., "path": ...}`) become `ImageBytes`.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from vlforge.data.inline import DataError, ImageBytes

PLACEHOLDER = re.compile(r"<(image|video)>")
# ShareGPT speaker names (LLaVA, LLaMA-Factory, ms-swift) -> chat roles
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
              "model": "assistant", "system": "system", "observation": "tool", "tool": "tool"}
_MEDIA = ("image", "images", "video", "videos")


def map_columns(row: dict, columns: dict | None, where: str) -> dict:
    """The row with data.columns applied: each of our keys takes the value of its column."""
    if not columns:
        return row
    out = dict(row)
    for ours, theirs in columns.items():
        if theirs not in row:
            raise DataError(f"{where}: missing column '{theirs}' (data.columns.{ours}); the row's columns are "
                            f"{', '.join(sorted(map(str, row)))}: fix data.columns or the row")
        value = out.pop(theirs)
        out[ours] = value
    return out


def image_value(value, where: str):
    """An image as a row gives it: a path string stays one; embedded bytes (`datasets`' Image
    feature: {"bytes": b"...", "path": name}, or raw bytes) become ImageBytes named after the row."""
    if isinstance(value, (bytes, bytearray)):
        return ImageBytes(bytes(value), where)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return ImageBytes(bytes(value["bytes"]), where)
        return value.get("path")  # bytes left out: a path (relative to the dataset's folder)
    return value


def _media_lists(row: dict, where: str) -> tuple[list, list]:
    """The row's top-level images and videos, in order (each key a value or a list)."""
    def listed(one: str, many: str) -> list:
        if one in row and many in row:
            raise DataError(f"{where}: give either '{one}' or '{many}', not both")
        value = row.get(many, row.get(one))
        if value is None:
            return []
        if many in row and not isinstance(value, list):
            raise DataError(f"{where}: '{many}' must be a list")
        # 'video' is one video: a file or a list of frames; 'image' one image
        items = value if many in row else [value]
        return [image_value(v, f"{where}: {many}[{k}]") for k, v in enumerate(items)] if one == "image" else items

    return listed("image", "images"), listed("video", "videos")


def _bind(text: str, images: list, videos: list, at: str) -> list[dict]:
    """`text` as parts, each placeholder replaced by the next image / video (consumed from the lists)."""
    parts, last = [], 0
    for match in PLACEHOLDER.finditer(text):
        if text[last:match.start()]:
            parts.append({"type": "text", "text": text[last:match.start()]})
        kind = match.group(1)
        queue = images if kind == "image" else videos
        if not queue:
            raise DataError(f"{at}: more <{kind}> placeholders than {kind}s")  # counted before: not reached
        parts.append({"type": kind, kind: queue.pop(0)})
        last = match.end()
    if text[last:]:
        parts.append({"type": "text", "text": text[last:]})
    return parts


def _check_counts(texts: list[str], images: list, videos: list, where: str) -> None:
    for kind, items in (("image", images), ("video", videos)):
        n = sum(t.count(f"<{kind}>") for t in texts)
        if n != len(items):
            raise DataError(f"{where}: {n} <{kind}> placeholder{'s' * (n != 1)} in the text but {len(items)} "
                            f"{kind}{'s' * (len(items) != 1)} in the row; each <{kind}> is bound to the row's next "
                            f"{kind}, in order, so the counts must be equal: add or remove placeholders or {kind}s")


def _from_sharegpt(row: dict, where: str) -> dict:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{\"from\", \"value\"}} turns")
    messages = []
    if isinstance(row.get("system"), str) and row["system"]:
        messages.append({"role": "system", "content": row["system"]})
    for i, turn in enumerate(turns):
        at = f"{where}: conversations[{i}]"
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if speaker not in ROLE_NAMES or not isinstance(text, str):
            raise DataError(f"{at}: a turn is {{\"from\": one of {', '.join(ROLE_NAMES)}, \"value\": text}}, got "
                            f"{str(turn)[:120]} (function_call turns: write the call as the assistant's "
                            "<tool_call> block in a 'messages' row)")
        messages.append({"role": ROLE_NAMES[speaker], "content": text})
    rest = {k: v for k, v in row.items() if k not in ("conversations", "system")}
    return {**rest, "messages": messages}


def _bind_messages(row: dict, where: str) -> dict:
    """A messages row with top-level image / video lists: each placeholder in its texts bound in order."""
    images, videos = _media_lists(row, where)
    messages = row["messages"]
    if not isinstance(messages, list):
        return row  # the chat parser says what a messages row must be
    texts = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
    _check_counts(texts, images, videos, where)
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and isinstance(msg.get("content"), str) and PLACEHOLDER.search(msg["content"]):
            msg = {**msg, "content": _bind(msg["content"], images, videos, f"{where}: messages[{i}]")}
        out.append(msg)
    rest = {k: v for k, v in row.items() if k not in _MEDIA}
    return {**rest, "messages": out}


def _simple_with_placeholders(row: dict, where: str) -> dict:
    """A simple row whose question places its images (`<image>` in 'prompt' / 'text'): a user turn
    with the images at their places, then the answer (checked by the simple row's rules first)."""
    key = "text" if "text" in row else "prompt"
    answer = row.get("answer")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer).strip() == "":
        raise DataError(f"{where}: 'answer' is missing, empty or not a string; every row needs a target response")
    images, videos = _media_lists(row, where)
    if "video" in row and not isinstance(row["video"], (str, list)):
        raise DataError(f"{where}: 'video' must be a file path or a list of frame paths")
    _check_counts([row[key]], images, videos, where)
    messages = [{"role": "user", "content": _bind(row[key], images, videos, f"{where}: '{key}'")},
                {"role": "assistant", "content": str(answer)}]
    if isinstance(row.get("system"), str):
        messages.insert(0, {"role": "system", "content": row["system"]})
    if "fps" in row:  # a frame list's rate moves onto its part
        for part in messages[-2]["content"]:
            if part["type"] == "video":
                part["fps"] = row["fps"]
    rest = {k: v for k, v in row.items() if k not in (*_MEDIA, key, "answer", "system", "fps")}
    return {**rest, "messages": messages}


def _inside(path: Path, base: Path, at: str) -> Path:
    if not path.resolve().is_relative_to(base.resolve()):
        raise DataError(f"{at}: image {path} is outside the dataset's folder {base}; image_url paths of a "
                        "dataset must lie inside its folder (copy the image there)")
    return path


def openai_image(url, base: Path, at: str):
    """An OpenAI image_url as an image: a data URL's bytes, a local file under `base`; remote refused."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise DataError(f"{at}: an image_url part is {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise DataError(f"{at}: a data URL image must be base64 (data:image/png;base64,...)")
        try:
            return ImageBytes(base64.b64decode(payload, validate=True), at)
        except (binascii.Error, ValueError):
            raise DataError(f"{at}: the data URL's base64 cannot be decoded; re-encode the image") from None
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp", "s3", "gs"):
        raise DataError(f"{at}: image_url {url[:80]} is a remote URL; vlforge never downloads during a run: "
                        "download the images into the dataset's folder and give their paths (or data URLs)")
    if scheme == "file":
        path = Path(unquote(urlparse(url).path))
    elif scheme and len(scheme) > 1:  # a one-letter scheme is a Windows drive
        raise DataError(f"{at}: image_url {url[:80]}: only data: URLs and local paths are read")
    else:
        path = Path(url)
    return str(_inside(path if path.is_absolute() else base / path, base, at))


def _openai_parts(row: dict, base: Path, where: str) -> dict:
    messages = row["messages"]
    if not isinstance(messages, list):
        return row
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            content = [{"type": "image", "image": openai_image(p.get("image_url"), base,
                                                               f"{where}: messages[{i}].content[{j}]")}
                       if isinstance(p, dict) and p.get("type") == "image_url" else p
                       for j, p in enumerate(content)]
            msg = {**msg, "content": content}
        out.append(msg)
    return {**row, "messages": out}


def _embedded_parts(row: dict, where: str) -> dict:
    """Image parts whose value is embedded bytes (a parquet set of messages rows) as ImageBytes."""
    out = []
    for i, msg in enumerate(row["messages"]):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            content = [{**p, "image": image_value(p["image"], f"{where}: messages[{i}].content[{j}]")}
                       if isinstance(p, dict) and p.get("type") == "image" and "image" in p else p
                       for j, p in enumerate(content)]
            msg = {**msg, "content": content}
        out.append(msg)
    return {**row, "messages": out}


def to_native(row: dict, where: str, base: Path, columns: dict | None = None) -> dict:
    """The row in vlforge's layout (see the module docstring); a native row comes back as it was,
    but for its embedded images (ImageBytes)."""
    row = map_columns(row, columns, where)
    if "conversations" in row:
        if "messages" in row:
            raise DataError(f"{where}: a row has either 'conversations' (ShareGPT) or 'messages', not both")
        row = _from_sharegpt(row, where)
    if "messages" in row:
        if any(k in row for k in _MEDIA):
            row = _bind_messages(row, where)
        if isinstance(row["messages"], list):
            row = _embedded_parts(_openai_parts(row, base, where), where)
        return row
    text = row.get("text", row.get("prompt"))
    if isinstance(text, str) and PLACEHOLDER.search(text) and not ("text" in row and "prompt" in row):
        return _simple_with_placeholders(row, where)
    if "image" in row or "images" in row:  # embedded images of a simple row
        images = row.get("images", row.get("image"))
        key = "images" if "images" in row else "image"
        if isinstance(images, list):
            row = {**row, key: [image_value(v, f"{where}: {key}[{k}]") for k, v in enumerate(images)]}
        else:
            row = {**row, key: image_value(images, f"{where}: {key}")}
    return row
