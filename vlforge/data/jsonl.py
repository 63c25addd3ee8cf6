"""Read and validate JSONL datasets into `Sample`s. Every problem names the file and line.

Two row schemas (image and video paths are relative to the JSONL file unless absolute):

    {"image": "a.png" | "images": ["a.png", "b.png"], "text" | "prompt": "...", "answer": "..."}
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                               {"type": "text", "text": "..."}]},
                  {"role": "assistant", "content": "..."}]}

A video is a list of frame image files in order (with "fps": the rate the frames were taken at,
default 2, Qwen3-VL's sampling rate) or a video file (decoded with PyAV: `pip install 'vlforge[video]'`;
its own rate is in the file): `"video": ["f0.png", "f1.png", ...]` or `"video": "clip.mp4"` in a
simple row, `{"type": "video", "video": ..., "fps": 2}` as a chat part. Only the headers are read
here (frame sizes, a file's frame count and rate); the frames are decoded when the sample is.

A chat row may be a tool-use trajectory: "tool" messages (a tool's result, after the assistant turn
that called it: text, and images or videos a tool returned, as parts) and a "tools" key, the
OpenAI-style function schemas the chat template shows the model
([{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}]).
Only assistant turns are trained on; tool messages are context.

Extra keys (e.g. "task") are kept in `Sample.fields` for metrics and reward functions.

Other tools' layouts (ShareGPT/LLaVA "conversations", top-level "images" bound to "<image>"
placeholders, OpenAI image_url parts, embedded image bytes) are read into these two first
(data/layouts.py). Nothing is dropped silently: a placeholder left unbound (no image list to bind
it to, or counts that differ) is an error that says how to write the row.
"""

from __future__ import annotations

import functools
import io
import json
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from PIL import Image, UnidentifiedImageError

from vlforge.data.inline import MAX_ASPECT, MAX_IMAGE_PIXELS, DataError, ImageBytes, path_problem
from vlforge.data.video import Video, read_video_header
from vlforge.data.layouts import to_native

ROLES = ("system", "user", "assistant", "tool")
# what PIL raises on a corrupt or truncated file, at open or at decode
_DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError)


DEFAULT_FRAME_FPS = 2.0  # a frame list's rate when the row gives none: Qwen3-VL's video sampling rate


@dataclass
class Sample:
    messages: list[dict]  # chat messages; image parts carry an absolute "image" path, video parts a Video
    images: list[Path | ImageBytes]  # in order of appearance (files, or embedded images)
    source: str  # "file:line", for error messages
    fields: dict = field(default_factory=dict)  # extra row keys (task, ...)
    tools: list[dict] | None = None  # function schemas the chat template renders (a chat row's "tools")
    videos: list[Video] = field(default_factory=list)  # in order of appearance

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

    def skip(self, error: Exception, reason: str | None = None) -> None:
        """Count a row left out (data.on_error=skip) under `reason` (default: the error's first clause,
        after its file:line), keeping the first few full messages."""
        text = str(error)
        self.skipped[reason or (text.split(": ", 1)[1] if ": " in text else text).split(" (")[0][:60]] += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(text)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


# -- image files: refuse bad ones from the header, before a single pixel is decoded ---------------


def open_image(path: str | Path | ImageBytes, where: str | None = None,
               max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Open an image reading only its header. Refuses (DataError) a file that is missing or not an
    image, has more than `max_pixels` pixels (a guard against decompression bombs) or an aspect
    ratio the model's image processor rejects. The caller closes it (`with open_image(...) as im`).
    An ImageBytes (an embedded image) gets the same checks, on its bytes."""
    at = f"{where}: " if where else ""
    if not isinstance(path, ImageBytes) and (problem := path_problem(path)):
        raise DataError(f"{at}image file {path} {problem}")
    try:
        with warnings.catch_warnings():
            # PIL warns above its own soft limit; our max_pixels below is the limit that decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(path.data) if isinstance(path, ImageBytes) else path)
    except FileNotFoundError:  # gone since the check above
        raise DataError(f"{at}image file {path} not found") from None
    except Image.DecompressionBombError as e:
        raise DataError(f"{at}image {path} is too large to decode safely ({e}); downscale it") from None
    except _DECODE_ERRORS as e:
        raise DataError(f"{at}image {path} cannot be decoded ({e}); re-export it as PNG/JPEG or drop the row") from None
    w, h = im.size
    if w * h > max_pixels:
        im.close()
        raise DataError(f"{at}image {path} is {w}x{h} = {w * h:,} pixels, over the limit of {max_pixels:,} "
                        "(a guard against decompression bombs); downscale it, or raise data.max_image_pixels")
    if max(w, h) > MAX_ASPECT * min(w, h):
        im.close()
        raise DataError(f"{at}image {path} is {w}x{h}: the image processor refuses aspect ratios over {MAX_ASPECT}; "
                        "crop or pad it, or drop the row")
    return im


def load_pixels(im: Image.Image, path: str | Path, where: str | None = None) -> None:
    """Decode an opened image in full (a truncated or corrupt file fails here, not at open)."""
    try:
        im.load()
    except _DECODE_ERRORS as e:
        at = f"{where}: " if where else ""
        raise DataError(f"{at}image {path} is truncated or corrupt ({e}); re-export it, "
                        "or drop the row or set data.on_error=skip") from None


def _resolve(value, where: str, base: Path, what: str) -> Path:
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: {what} must be a non-empty path string, got {value!r}")
    path = Path(value)
    path = path if path.is_absolute() else base / path
    if problem := path_problem(path):
        hint = " (paths are relative to the JSONL file's folder)" if problem == "not found" else ""
        raise DataError(f"{where}: {what} {path} {problem}{hint}")
    return path


def _checked_image(value, where: str, base: Path, max_pixels: int,
                   decode: bool) -> tuple[Path | ImageBytes, tuple[int, int]]:
    """An image file's path (or an embedded image) and (width, height), from its header (decoded in
    full with `decode`)."""
    path = value if isinstance(value, ImageBytes) else _resolve(value, where, base, "image file")
    with open_image(path, where, max_pixels) as im:
        if decode:  # data check: a row it reports as valid must also decode at training time
            load_pixels(im, path, where)
        return path, im.size


def _image_path(value, where: str, *, base: Path, max_pixels: int, decode: bool) -> Path | ImageBytes:
    return _checked_image(value, where, base, max_pixels, decode)[0]


def _video(value, fps, where: str, *, base: Path, max_pixels: int, decode: bool) -> Video:
    """A row's video (a file path, or a list of frame paths) from its headers."""
    if isinstance(value, list):
        if len(value) < 2:
            raise DataError(f"{where}: a video needs at least 2 frames, got {len(value)}; give one frame as an image")
        if fps is None:
            fps = DEFAULT_FRAME_FPS
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
            raise DataError(f"{where}: 'fps' must be a positive number (the rate the frames were taken at), got {fps!r}")
        frames = [_checked_image(v, f"{where} frame {k}", base, max_pixels, decode) for k, v in enumerate(value)]
        size = frames[0][1]
        for k, (path, other) in enumerate(frames):
            if other != size:
                raise DataError(f"{where} frame {k} ({path}) is {other[0]}x{other[1]}, frame 0 is "
                                f"{size[0]}x{size[1]}; every frame of a video must have the same size")
        return Video(tuple(path for path, _ in frames), len(frames), float(fps), size)
    if fps is not None:
        raise DataError(f"{where}: 'fps' is for a list of frames; a video file's rate is read from the file "
                        "(set data.video_fps to sample more or fewer frames per second)")
    path = _resolve(value, where, base, "video file")
    return read_video_header(path, where, decode, max_pixels)


# "<image>" / "<video>" left in a text after the layouts were read (data/layouts.py binds the
# placeholders of rows that list their images beside the text): nothing binds these, so the model
# would read the literal text.
_PLACEHOLDER = re.compile(r"<(image|video)>")
LAYOUTS = ('{"image": path | "images": [paths] | "video": ..., "text": question, "answer": target} or '
           '{"messages": [{"role": ..., "content": text or [parts]}, ...]} (docs/data.md)')


def _no_placeholder(text: str, at: str, simple: bool) -> None:
    if match := _PLACEHOLDER.search(text):
        kind = match.group(1)
        raise DataError(f"{at}: the text holds a {match.group()} placeholder, but no {kind} is bound to it: a row "
                        f"binds its placeholders to a top-level '{kind}s' list (in order, as many of each), and "
                        f"this row's {kind}s are message parts; replace it by {{\"type\": \"{kind}\", "
                        f'"{kind}": path}} as a part at its place, or give the {kind}s as a top-level list')


def _part_value(image: Path | ImageBytes) -> str | ImageBytes:
    return image if isinstance(image, ImageBytes) else str(image)


def _from_simple(row: dict, image_at: Callable, where: str,
                 video_at: Callable) -> tuple[list[dict], list[Path], list[Video]]:
    if "image" in row and "images" in row:
        raise DataError(f"{where}: give either 'image' or 'images', not both")
    raw_images = row.get("images", [row["image"]] if "image" in row else [])
    if not isinstance(raw_images, list):
        raise DataError(f"{where}: 'images' must be a list of paths")
    text_key = "text" if "text" in row else "prompt" if "prompt" in row else None
    if text_key is None:
        raise DataError(f"{where}: missing key 'text' (or 'prompt'): the question to ask about the image(s); "
                        f"rows are {LAYOUTS}")
    if "answer" not in row:
        raise DataError(f"{where}: missing key 'answer': the target response")
    text, answer = row[text_key], row["answer"]
    if not isinstance(text, str):
        raise DataError(f"{where}: '{text_key}' must be a string")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer).strip() == "":
        raise DataError(f"{where}: 'answer' is empty or not a string; every row needs a target response")
    for key in (text_key, "answer", "system"):
        if isinstance(row.get(key), str):
            _no_placeholder(row[key], f"{where}: '{key}'", simple=True)
    images = [image_at(v, where) for v in raw_images]
    if "fps" in row and "video" not in row:
        raise DataError(f"{where}: 'fps' is the rate of a 'video' given as frames; this row has no 'video'")
    videos = [video_at(row["video"], row.get("fps"), f"{where}: video")] if "video" in row else []
    user = ([{"type": "image", "image": _part_value(p)} for p in images] + [{"type": "video", "video": v} for v in videos]
            + [{"type": "text", "text": text}])
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": str(answer)}]
    if isinstance(row.get("system"), str):
        messages.insert(0, {"role": "system", "content": row["system"]})
    return messages, images, videos


def _from_chat(row: dict, image_at: Callable, where: str,
               video_at: Callable) -> tuple[list[dict], list[Path], list[Video]]:
    messages, images, videos = [], [], []
    if not isinstance(row["messages"], list) or not row["messages"]:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, msg in enumerate(row["messages"]):
        at = f"{where}: messages[{i}]"
        calls = _openai_tool_calls(msg, at) if isinstance(msg, dict) and msg.get("role") == "assistant" else ""
        if calls:  # OpenAI's shape: the calls written into the turn as the model writes them (as serve does)
            text = msg.get("content") or ""
            if not isinstance(text, str):
                raise DataError(f"{at}: an assistant message with tool_calls needs a string content (or none)")
            msg = {**msg, "content": f"{text}\n{calls}" if text else calls}
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or "content" not in msg:
            raise DataError(f"{at} needs 'role' (one of {', '.join(ROLES)}) and 'content'")
        content = msg["content"]
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    path = image_at(part.get("image", part.get("path")), f"{at}.content[{j}]")
                    images.append(path)
                    parts.append({"type": "image", "image": _part_value(path)})
                elif kind == "video":
                    video = video_at(part.get("video", part.get("path")), part.get("fps"), f"{at}.content[{j}]")
                    videos.append(video)
                    parts.append({"type": "video", "video": video})
                elif kind == "text" and isinstance(part.get("text"), str):
                    _no_placeholder(part["text"], f"{at}.content[{j}]", simple=False)
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise DataError(f"{at}.content[{j}]: parts must be {{\"type\": \"image\", \"image\": path}}, "
                                    "{\"type\": \"video\", \"video\": a file or a list of frame paths} "
                                    f"or {{\"type\": \"text\", \"text\": str}}, got {part!r}")
            content = parts
        elif not isinstance(content, str):
            raise DataError(f"{at}: content must be a string or a list of parts")
        else:
            _no_placeholder(content, f"{at}.content", simple=False)
        if msg["role"] == "tool" and not (messages and (messages[-1]["role"] == "tool" or (
                messages[-1]["role"] == "assistant" and "<tool_call>" in _text_of(messages[-1]["content"])))):
            raise DataError(f"{at}: a tool message answers a tool call: it must follow an assistant message that "
                            "calls a tool (a <tool_call> block, or OpenAI's tool_calls) or another tool message")
        if msg["role"] == "assistant" and any(p["type"] != "text" for p in (content if isinstance(content, list) else [])):
            raise DataError(f"{at}: assistant messages cannot contain images or videos")
        messages.append({"role": msg["role"], "content": content})
    if messages[-1]["role"] != "assistant" or not _text_of(messages[-1]["content"]).strip():
        raise DataError(f"{where}: the last message must be a non-empty assistant answer (the training target)")
    return messages, images, videos


def parse_row(line: str, base: Path, where: str, max_image_pixels: int = MAX_IMAGE_PIXELS,
              decode_images: bool = False, columns: dict | None = None) -> Sample:
    """One JSONL line as a Sample (see `parse_obj`)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); each line must be one JSON object") from e
    return parse_obj(row, base, where, max_image_pixels, decode_images, columns)


def parse_obj(row, base: Path, where: str, max_image_pixels: int = MAX_IMAGE_PIXELS,
              decode_images: bool = False, columns: dict | None = None) -> Sample:
    """One row (a JSON object, a parquet row) as a Sample: other tools' layouts read first
    (data/layouts.to_native: ShareGPT/LLaVA, top-level image lists with placeholders, OpenAI
    image_url parts, embedded bytes, data.columns), image paths resolved against `base` and checked."""
    image_at = functools.partial(_image_path, base=base, max_pixels=max_image_pixels, decode=decode_images)
    video_at = functools.partial(_video, base=base, max_pixels=max_image_pixels, decode=decode_images)
    if not isinstance(row, dict):
        raise DataError(f"{where}: each row must be a JSON object, got {type(row).__name__}")
    row = to_native(row, where, base, columns)
    tools = None
    if "videos" in row and "messages" not in row:
        raise DataError(f"{where}: 'videos' is not a key of a simple row: give one video as 'video', or several as "
                        "video parts of a 'messages' row")
    if "messages" in row:
        messages, images, videos = _from_chat(row, image_at, where, video_at)
        tools = _tool_schemas(row.get("tools"), where)
        extra = {k: v for k, v in row.items() if k not in ("messages", "tools")}
    else:
        messages, images, videos = _from_simple(row, image_at, where, video_at)
        extra = {k: v for k, v in row.items()
                 if k not in ("image", "images", "video", "fps", "text", "prompt", "answer", "system")}
    return Sample(messages=messages, images=images, source=where, fields=extra, tools=tools, videos=videos)


def _openai_tool_calls(msg: dict, at: str) -> str:
    """An assistant message's OpenAI-style "tool_calls" ([{"type": "function", "function": {"name",
    "arguments" (a JSON object, as text or as an object)}}]) in Qwen's <tool_call> format; "" without."""
    from vlforge.tools.calls import ToolCall, format_tool_calls

    raw = msg.get("tool_calls")
    if not raw:
        return ""
    calls = []
    for j, call in enumerate(raw if isinstance(raw, list) else [None]):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(args, dict)):
            raise DataError(f"{at}.tool_calls[{j}]: must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                            "\"arguments\": a JSON object}}}")
        calls.append(ToolCall(fn["name"], args))
    return format_tool_calls(calls)


def _tool_schemas(tools, where: str) -> list[dict] | None:
    """A chat row's "tools": None, or a list of function schemas (as transformers' get_json_schema makes)."""
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        for t in tools)
    if not ok:
        raise DataError(f"{where}: 'tools' must be a list of function schemas, each "
                        '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    return tools


def _text_line(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # -sig: tolerate a byte-order mark at the start
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "re-export the file as UTF-8, or drop the row or set data.on_error=skip") from None


def read_jsonl(path: str | Path, on_error: str = "fail", report: LoadReport | None = None, *,
               max_image_pixels: int = MAX_IMAGE_PIXELS, decode_images: bool = False) -> list[Sample]:
    """Parse every row. on_error="fail" raises the first DataError; "skip" counts it in `report`.

    Images are checked from their headers (size, aspect, format); `decode_images=True` also decodes
    each in full, which finds truncated files (data check). A file with no rows is an error.
    """
    path = Path(path)
    if problem := path_problem(path):
        raise DataError(f"{path}: dataset file {problem}")
    report = report if report is not None else LoadReport()
    samples, rows = [], 0
    try:
        f = open(path, "rb")  # bytes: a line that is not UTF-8 is one bad row (file:line), not a crash
    except OSError as e:
        raise DataError(f"{path}: cannot read the dataset file ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            rows += 1
            where = f"{path}:{lineno}"
            try:
                line = _text_line(raw, where, first=lineno == 1)
                samples.append(parse_row(line, path.parent, where, max_image_pixels, decode_images))
            except DataError as e:
                if on_error == "fail":
                    raise
                report.skip(e)
    if rows == 0:
        raise DataError(f"{path}: has no rows (the file is empty or holds only blank lines); "
                        "write one JSON object per line")
    report.rows += rows
    report.kept += len(samples)
    return samples
