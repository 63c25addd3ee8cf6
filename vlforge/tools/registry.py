"""What a tool is: a Python function with type hints and a Google-style docstring; transformers'
`get_json_schema` turns it into the JSON schema the chat template shows the model::

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "(2 + 3) * 4".
        \"\"\"

`tools.names` lists builtins (tools/builtin.py: ``calculator``, ``zoom_in``) or
``path/to/file.py:function``. A tool may return images (a PIL image, or a list of text and images):
the model sees them in its tool message, before the text. A tool with a parameter named ``images``
gets the prompt's images there (PIL, RGB, full size, in order; the parameter is not in its schema,
so the model never writes it): how a tool crops or measures what the model is looking at.
How the model writes a call is tools/calls.py; how a call runs (threads, worker processes) tools/runner.py.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from vlforge.plugins import load_callable
from vlforge.tools.builtin import BUILTIN_TOOLS

TOOL_SIGNATURE = "fn(**arguments) -> str (type hints and a docstring with an Args section)"
IMAGES_ARGUMENT = "images"  # a tool parameter the rollout fills with the prompt's images (not in the schema)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {name, description, parameters}}: what the template renders
    spec: str = ""  # the tools.names entry it came from (a worker process loads it again from this)

    @property
    def takes_images(self) -> bool:
        """Whether the function has an `images` parameter: the prompt's images are passed there."""
        return takes_images(self.fn)


def takes_images(fn: Callable[..., Any]) -> bool:
    return IMAGES_ARGUMENT in inspect.signature(fn).parameters


def _schema_view(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the model sees it: without its `images` parameter (filled by the rollout), so that
    transformers' get_json_schema neither shows it nor asks the docstring to describe it."""
    if not takes_images(fn):
        return fn
    signature = inspect.signature(fn)

    @functools.wraps(fn)  # its name, docstring and module globals (string annotations resolve there)
    def view(*args, **kwargs):
        return fn(*args, **kwargs)

    view.__signature__ = signature.replace(parameters=[p for name, p in signature.parameters.items()
                                                       if name != IMAGES_ARGUMENT])
    view.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != IMAGES_ARGUMENT}
    return view


def load_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """The tools of `specs` (builtin names or ``path.py:function``) by name, each with its schema;
    a spec that is not a usable tool raises a ValueError naming it and what to fix."""
    from transformers.utils import get_json_schema

    tools: dict[str, Tool] = {}
    for spec in specs:
        fn = tool_function(spec)
        try:
            schema = get_json_schema(_schema_view(fn))
        except Exception as e:  # transformers raises its own TypeError / DocstringParsingException
            raise ValueError(f"tool {spec!r}: no JSON schema from its signature and docstring ({e}); give every "
                             "argument a type hint and document it in an 'Args:' section") from e
        # OpenAI's function schema has no return type: the prompts of training are then the ones an
        # OpenAI client's `tools` give the served model (vlforge serve renders those)
        schema["function"].pop("return", None)
        name = schema["function"]["name"]
        if name in tools:
            raise ValueError(f"tool {spec!r}: a second tool named {name!r}; tool names must be unique")
        tools[name] = Tool(name, fn, schema, spec)
    return tools


def tool_function(spec: str) -> Callable[..., Any]:
    """The function of one tools.names entry: a builtin name or ``path.py:function`` (ValueError
    naming what to fix)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    if ":" in spec:
        try:
            return load_callable(spec, "tool", TOOL_SIGNATURE)
        except (FileNotFoundError, ImportError, AttributeError, TypeError) as e:
            raise ValueError(str(e)) from e
    raise ValueError(f"unknown tool {spec!r}: use a builtin ({', '.join(BUILTIN_TOOLS)}) or "
                     "'path/to/file.py:function_name'")
