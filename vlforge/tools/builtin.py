"""The tools vlforge ships (`tools.names: [calculator, zoom_in]`): plain functions with type hints and
a docstring with an Args section, as any tool (tools/ turns them into the schemas the model sees).

    calculator(expression)              arithmetic on numbers, + - * / // % ** and parentheses, nothing else
    zoom_in(bbox_2d, image=1, images)   a region of one of the prompt's images, at full resolution
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from PIL import Image

_MAX_BITS = 4096  # the calculator's largest integer result


def _calculator_value(node: ast.AST) -> float:
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    if isinstance(node, ast.Expression):
        return _calculator_value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _calculator_value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
        left, right = _calculator_value(node.left), _calculator_value(node.right)
        # a sampled response must not hold the process (and the GIL) in one huge big-integer power
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1 and
                                             math.log2(abs(left)) * abs(right) > _MAX_BITS):
            raise ValueError(f"the power is too large (results of at most {_MAX_BITS} bits)")
        value = ops[type(node.op)](left, right)
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > _MAX_BITS:
            raise ValueError(f"the result is too large (at most {_MAX_BITS} bits)")
        return value
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: numbers, + - * / // % ** and parentheses only")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and parentheses, e.g. "(2 + 3) * 4".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _calculator_value(tree)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not finite")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


ZOOM_MIN_SIDE = 64  # a zoomed region's shorter side is enlarged to at least this many pixels


def zoom_in(bbox_2d: list[float], image: int = 1, images: list | None = None) -> list:
    """Zoom in on a region of one of the user's images: returns the region at full resolution.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], each coordinate from 0 to 1000 relative to the image's width and height (0, 0 is the top left).
        image: Which of the user's images, counting from 1.
    """
    # Qwen3-VL grounds in coordinates relative to 0..1000 (Qwen2.5-VL used pixels of the resized image)
    if not images:
        raise ValueError("the user gave no image to zoom into")
    if isinstance(image, float) and image.is_integer():
        image = int(image)
    if isinstance(image, bool) or not isinstance(image, int) or not 1 <= image <= len(images):
        raise ValueError(f"image must be a number from 1 to {len(images)}")
    if (not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox_2d)):
        raise ValueError("bbox_2d must be four numbers [x1, y1, x2, y2] from 0 to 1000")
    if not all(0 <= v <= 1000 for v in bbox_2d):
        raise ValueError(f"bbox_2d {list(bbox_2d)} leaves the image: coordinates are relative, from 0 to 1000 "
                         "(not pixels)")
    x1, y1, x2, y2 = (float(v) for v in bbox_2d)
    if x2 <= x1 or y2 <= y1:
        raise ValueError("bbox_2d must have x1 < x2 and y1 < y2")
    im = images[image - 1]
    W, H = im.size
    box = (int(x1 * W / 1000), int(y1 * H / 1000), max(int(x1 * W / 1000) + 1, round(x2 * W / 1000)),
           max(int(y1 * H / 1000) + 1, round(y2 * H / 1000)))
    crop = im.crop(box)
    w, h = crop.size
    if max(w, h) > 100 * min(w, h):
        raise ValueError(f"the region is {w}x{h} pixels: too thin to look at (at most 100:1)")
    if min(w, h) < ZOOM_MIN_SIDE:  # too small for the vision tower's patches: enlarged, its shape kept
        scale = ZOOM_MIN_SIDE / min(w, h)
        crop = crop.resize((max(ZOOM_MIN_SIDE, round(w * scale)), max(ZOOM_MIN_SIDE, round(h * scale))),
                           Image.Resampling.BICUBIC)
    region = ", ".join(f"{v:g}" for v in (x1, y1, x2, y2))
    return [crop, f"image {image}, region [{region}] ({box[2] - box[0]}x{box[3] - box[1]} pixels)"]


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "zoom_in": zoom_in}
