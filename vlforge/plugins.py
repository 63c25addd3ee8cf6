"""User code a config names: ``path/to/file.py:function`` loaded from its file, every failure a
clear error naming the spec and what to do (rewards and tools are loaded this way)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable


def load_callable(spec: str, kind: str, signature: str) -> Callable:
    """The function `name` of the Python file of a ``path/to/file.py:name`` spec (a user's reward
    or tool); every failure a clear error naming the spec and what to do."""
    path_str, fn_name = spec.rsplit(":", 1)
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{kind} {spec!r}: file {str(path)!r} not found (cwd {Path.cwd()}); "
            f"give an existing path to a .py file, e.g. '{kind}s/my_{kind}.py:my_fn'"
        )
    mod_name = f"vlforge_user_{kind}_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{kind} {spec!r}: cannot import {str(path)!r}; it must be a Python (.py) file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # lets dataclasses/pickle inside the file resolve the module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ImportError(f"{kind} {spec!r}: importing {str(path)!r} failed: {e!r}; fix the file") from e
    if not hasattr(module, fn_name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(
            f"{kind} {spec!r}: {str(path)!r} has no function {fn_name!r}; "
            f"define it or use one of: {', '.join(public) or '(no public callables)'}"
        )
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise TypeError(f"{kind} {spec!r}: {fn_name!r} is a {type(fn).__name__}, not callable; it must be a "
                        f"function {signature}")
    return fn
