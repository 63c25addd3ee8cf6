"""Synthetic "shapes" dataset: images of coloured shapes with checkable questions.

Every answer is a single word or number that can be verified exactly, which makes the data
useful both for SFT (exact-match accuracy) and for GRPO (verifiable rewards). Generation is
deterministic for a seed: the same seed gives byte-identical images and JSONL.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
RGB = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220),
    "yellow": (235, 210, 20), "purple": (140, 40, 180), "orange": (245, 130, 20),
}
SHAPES = ["circle", "square", "triangle"]
POSITIONS = ["left", "right"]
TASKS = ("colour", "shape", "position", "count")

QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is in the image?",
    "position": "Is the shape on the left or the right?",
    "count": "How many shapes are there?",
}


def question_templates() -> list[str]:
    return list(QUESTIONS.values())


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: float
    cy: float
    radius: float


def draw(shapes: list[Shape], size: int, lines: list[tuple[float, float, float, float]] = ()) -> Image.Image:
    """White, then grey `lines` (x1, y1, x2, y2; clutter), then the shapes on top."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for line in lines:
        pen.line(line, fill=(150, 150, 150), width=2)
    for s in shapes:
        box = (s.cx - s.radius, s.cy - s.radius, s.cx + s.radius, s.cy + s.radius)
        fill = RGB[s.colour]
        if s.kind == "circle":
            pen.ellipse(box, fill=fill)
        elif s.kind == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(s.cx, s.cy - s.radius), (s.cx - s.radius, s.cy + s.radius),
                         (s.cx + s.radius, s.cy + s.radius)], fill=fill)
    return image


def _single_shape(rng: random.Random, size: int, side: str | None = None) -> Shape:
    # Large shapes (a third of the image) make circle/square/triangle distinguishable at the tiny
    # model's 8-pixel patches; a shape placed left or right must fit in one half.
    radius = rng.uniform(0.16, 0.22) * size if side else rng.uniform(0.24, 0.34) * size
    lo, hi = radius + 1, size - radius - 1
    if side == "left":
        hi = size / 2 - radius * 0.5
    elif side == "right":
        lo = size / 2 + radius * 0.5
    return Shape(rng.choice(SHAPES), rng.choice(COLOURS), rng.uniform(lo, hi), rng.uniform(radius + 1, size - radius - 1), radius)


def _scattered_shapes(rng: random.Random, size: int, n: int) -> list[Shape]:
    """n non-overlapping small shapes on a grid of cells, so that counting is well defined."""
    cells_per_side = 3
    cell = size / cells_per_side
    cells = rng.sample(range(cells_per_side**2), n)
    radius = cell * 0.3
    out = []
    for c in cells:
        row, col = divmod(c, cells_per_side)
        jitter = cell * 0.12
        cx = (col + 0.5) * cell + rng.uniform(-jitter, jitter)
        cy = (row + 0.5) * cell + rng.uniform(-jitter, jitter)
        out.append(Shape(rng.choice(SHAPES), rng.choice(COLOURS), cx, cy, radius))
    return out


def make_sample(rng: random.Random, task: str, size: int) -> tuple[Image.Image, str, str]:
    """Returns (image, question, answer) for one task."""
    if task == "count":
        n = rng.randint(1, 4)
        return draw(_scattered_shapes(rng, size, n), size), QUESTIONS[task], str(n)
    if task == "position":
        side = rng.choice(POSITIONS)
        return draw([_single_shape(rng, size, side)], size), QUESTIONS[task], side
    shape = _single_shape(rng, size)
    answer = shape.colour if task == "colour" else shape.kind
    return draw([shape], size), QUESTIONS[task], answer


def _write_splits(out: Path, rows: list[dict], n_val: int) -> dict[str, Path]:
    """out/val.jsonl (the first `n_val` rows) and out/train.jsonl (the rest); returns their paths."""
    return _write_jsonl(out, {"train": ("train.jsonl", rows[n_val:]), "val": ("val.jsonl", rows[:n_val])})


def _write_jsonl(out: Path, files: dict[str, tuple[str, list[dict]]]) -> dict[str, Path]:
    """Each list of rows to its file under `out`: {key: path}."""
    paths = {}
    for key, (name, rows) in files.items():
        paths[key] = out / name
        with open(paths[key], "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return paths


def synth_shapes(out_dir: str | Path, n: int, *, seed: int = 0, val_fraction: float = 0.1,
                 size: int = 64, tasks: tuple[str, ...] = TASKS) -> dict[str, Path]:
    """Write `n` samples as out_dir/{train,val}.jsonl + out_dir/images/*.png. Returns the JSONL paths."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown shapes task(s) {unknown}; choose from {list(TASKS)}")
    if n < 2:
        raise ValueError(f"--n must be at least 2 (one train and one val sample), got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n_val = max(1, round(n * val_fraction))
    rows = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        image, question, answer = make_sample(rng, task, size)
        name = f"images/{i:06d}.png"
        image.save(out / name)
        rows.append({"image": name, "text": question, "answer": answer, "task": task})
    return _write_splits(out, rows, n_val)


MOTION_QUESTION = "Which way does the shape move, left or right?"


def synth_motion(out_dir: str | Path, n: int, *, seed: int = 0, val_fraction: float = 0.1, size: int = 64,
                 frames: int = 6, fps: float = 2.0) -> dict[str, Path]:
    """Video data: `frames` frames of one shape sliding left or right across the image ("Which way
    does the shape move?" -> left/right: no single frame answers it). Each video is a list of PNG
    frames (`"video": [...]`, `"fps"`), out_dir/{train,val}.jsonl + out_dir/videos/. Returns the JSONL paths."""
    if n < 2:
        raise ValueError(f"--n must be at least 2 (one train and one val sample), got {n}")
    if frames < 2:
        raise ValueError(f"a video needs at least 2 frames, got {frames}")
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n_val = max(1, round(n * val_fraction))
    rows = []
    for i in range(n):
        direction = rng.choice(POSITIONS)
        shape = _single_shape(rng, size)
        radius = shape.radius * 0.6  # room to travel
        start, end = radius + 1, size - radius - 1
        if direction == "left":
            start, end = end, start
        names = []
        for k in range(frames):
            x = start + (end - start) * k / (frames - 1)
            name = f"videos/{i:06d}-{k:02d}.png"
            draw([Shape(shape.kind, shape.colour, x, shape.cy, radius)], size).save(out / name)
            names.append(name)
        rows.append({"video": names, "fps": fps, "text": MOTION_QUESTION, "answer": direction, "task": "motion"})
    return _write_splits(out, rows, n_val)


TOOL_QUESTION = "Count the shapes, then use the calculator to multiply the count by {factor}."


def synth_tool_use(out_dir: str | Path, n: int, *, seed: int = 0, size: int = 64) -> dict[str, Path]:
    """Tool-use data on shapes images: "count the shapes, multiply by k with the calculator".

    Writes out_dir/tools_sft.jsonl (chat rows: the calculator call, its result as a tool message, the
    final `<answer>`; the calculator's schema in "tools": SFT teaches the format), out_dir/tools_prompts.jsonl
    (the same questions with the final answer, for GRPO with tools.names=[calculator]) and the images.
    Returns {"sft": path, "prompts": path}."""
    from vlforge.tools.builtin import calculator
    from vlforge.tools.registry import load_tools

    schemas = [tool.schema for tool in load_tools(["calculator"]).values()]
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sft, prompts = [], []
    for i in range(n):
        count, factor = rng.randint(1, 4), rng.randint(2, 9)
        name = f"images/tool-{i:06d}.png"
        draw(_scattered_shapes(rng, size, count), size).save(out / name)
        question = TOOL_QUESTION.format(factor=factor)
        expression = f"{count} * {factor}"
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        result = calculator(expression)
        user = {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]}
        sft.append({"messages": [user, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                                 {"role": "tool", "content": result},
                                 {"role": "assistant", "content": f"<answer>{result}</answer>"}],
                    "tools": schemas})
        prompts.append({"image": name, "text": question, "answer": result})
    return _write_jsonl(out, {"sft": ("tools_sft.jsonl", sft), "prompts": ("tools_prompts.jsonl", prompts)})


ZOOM_QUESTION = "What colour is the small shape? Zoom in on it first."


def synth_zoom(out_dir: str | Path, n: int, *, seed: int = 0, size: int = 64) -> dict[str, Path]:
    """"Think with images" data: a (4 x size)-pixel image with one small shape (about 3% of its side:
    a few pixels once the processor shrinks the image) and grey clutter; "what colour is it?".

    Writes out_dir/zoom_sft.jsonl (chat rows: a zoom_in call on the shape's region in Qwen3-VL's
    0..1000 coordinates, the builtin tool's own result as a tool message, its crop an image part,
    then the `<answer>`; SFT teaches the pattern), out_dir/zoom_prompts.jsonl (the questions and
    answers, for GRPO with tools.names=[zoom_in]) and the images. Returns {"sft": path, "prompts": path}."""
    from vlforge.tools.builtin import zoom_in
    from vlforge.tools.registry import load_tools

    schemas = [tool.schema for tool in load_tools(["zoom_in"]).values()]
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    side = 4 * size
    radius = 0.03 * side
    sft, prompts = [], []
    for i in range(n):
        shape = Shape(rng.choice(SHAPES), rng.choice(COLOURS), rng.uniform(0.1, 0.9) * side,
                      rng.uniform(0.1, 0.9) * side, radius)
        starts = [(rng.uniform(0, side), rng.uniform(0, side)) for _ in range(6)]
        lines = [(x, y, x + rng.uniform(-0.2, 0.2) * side, y + rng.uniform(-0.2, 0.2) * side) for x, y in starts]
        image = draw([shape], side, lines)  # clutter the model must look past, under the shape
        name = f"images/zoom-{i:06d}.png"
        image.save(out / name)
        margin = 2.5 * radius
        bbox = [max(0, min(1000, round(1000 * v / side))) for v in (shape.cx - margin, shape.cy - margin,
                                                                       shape.cx + margin, shape.cy + margin)]
        crop, result = zoom_in(bbox, images=[image])
        crop_name = f"images/zoom-{i:06d}-crop.png"
        crop.save(out / crop_name)
        call = json.dumps({"name": "zoom_in", "arguments": {"bbox_2d": bbox}})
        user = {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": ZOOM_QUESTION}]}
        sft.append({"messages": [user, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                                 {"role": "tool", "content": [{"type": "image", "image": crop_name},
                                                              {"type": "text", "text": result}]},
                                 {"role": "assistant", "content": f"<answer>{shape.colour}</answer>"}],
                    "tools": schemas})
        prompts.append({"image": name, "text": ZOOM_QUESTION, "answer": shape.colour})
    return _write_jsonl(out, {"sft": ("zoom_sft.jsonl", sft), "prompts": ("zoom_prompts.jsonl", prompts)})
