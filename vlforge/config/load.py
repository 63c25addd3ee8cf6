"""The loader of typed recipe configs: YAML files as instances of the dataclasses, dotted CLI
overrides, old keys, range checks. The sections themselves live with their components' files
(model.py, data.py, train.py, rl.py); recipes.py composes them.

    cfg = load_config(SFTConfig, "configs/demo-sft.yaml", ["tiers.language.lr=1e-3", "train.max_steps=10"])

Unknown keys are errors that name the key, where it came from, and the nearest valid key; a key
that moved (RENAMED) names its new place.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user must fix: the message says where and what to do."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class _OutOfRange(ConfigError):
    """A field outside its range, named relative to its section: `_build` prefixes the section's
    path, so a section used in several places (tiers.language, tiers.vision) names the full key."""


def _range(section: Any, key: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, why: str = "") -> None:
    """Check a numeric field (each element of a tuple; null passes: the type says if it may be null).

    Floats must also be finite: an inf learning rate or clip norm trains into NaN weights."""
    value = getattr(section, key)
    for v in value if isinstance(value, tuple) else (value,):
        if v is None:
            continue
        ok = (isinstance(v, int) or math.isfinite(v)) and not (
            (ge is not None and v < ge) or (gt is not None and v <= gt)
            or (le is not None and v > le) or (lt is not None and v >= lt))
        if not ok:
            raise _OutOfRange(f"{key} must be {_rule(ge, gt, le, lt)}, got {value!r}" + (f": {why}" if why else ""))


def _rule(ge, gt, le, lt) -> str:
    if (ge is not None or gt is not None) and (le is not None or lt is not None):
        lo = f"[{ge:g}" if ge is not None else f"({gt:g}"
        hi = f"{le:g}]" if le is not None else f"{lt:g})"
        return f"in {lo}, {hi}"
    for op, bound in ((">=", ge), (">", gt), ("<=", le), ("<", lt)):
        if bound is not None:
            return f"{op} {bound:g}"
    return "a finite number"


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid keys: {', '.join(valid)}"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if errors else f"{where}: cannot be null")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
        return _build(tp, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _string_keys(value, where)
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # .inf / .nan: no setting means "infinitely much"
            raise ConfigError(f"{where}: must be a finite number, got {value}")
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    if value is None:
        raise ConfigError(f"{where}: cannot be null")
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _string_keys(data: dict, where: str) -> None:
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{where + ': ' if where else ''}key {key!r} is not a name; keys must be strings "
                              "(quote it in YAML if it is meant as one)")


def _build(cls: type, data: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    _string_keys(data, where)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown key '{path}': {_suggest(key, names)}")
        fld = next(f for f in dataclasses.fields(cls) if f.name == key)
        if isinstance(value, dict) and fld.default_factory is not dataclasses.MISSING:
            default = fld.default_factory()
            if dataclasses.is_dataclass(default):  # a partial section keeps this field's own defaults
                unknown = [k for k in value if k not in {f.name for f in dataclasses.fields(default)}]
                if not unknown:
                    value = merge(to_dict(default), value)
        try:
            kwargs[key] = _coerce(value, hints[key], path)
        except ConfigError as e:  # a key whose only valid values are few says why (quant.experts)
            raise ConfigError(f"{e}: {fld.metadata['why']}" if "why" in fld.metadata else str(e)) from None
    try:
        return cls(**kwargs)  # __post_init__ range checks raise ConfigError naming their key
    except _OutOfRange as e:
        raise ConfigError(f"{where}.{e}" if where else str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{k}' is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value (e.g. tiers.language.lr=1e-4)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({getattr(e, 'problem', e)}); "
                              "quote it if it is meant as text") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_file(path: str | Path | None) -> dict:
    """The YAML file's mapping, or {} without a file."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw.decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from defaults <- YAML file <- dotted overrides. Raises ConfigError on any bad key,
    an old key (RENAMED) included."""
    return build_named(cls, read_file(path), path, overrides or [])


def build_named(cls: type, file_tree: dict, path: str | Path | None, overrides: list[str]):
    """`cls` from a file's tree and overrides; an error names the file or the override that caused it."""
    check_old_keys(file_tree, str(path) if path else "config")
    for item in overrides:
        check_old_keys(parse_overrides([item]), f"override {item!r}")
    tree = merge(file_tree, parse_overrides(overrides))  # a malformed override names itself
    try:
        return _build(cls, tree, "")
    except ConfigError as e:
        raise ConfigError(_blame(cls, file_tree, path, overrides, str(e))) from None


def _blame(cls: type, file_tree: dict, path: str | Path | None, overrides: list[str], message: str) -> str:
    """The error named after whoever gave the bad value: the file when it fails alike on its own,
    else the overrides without which this error is gone (two that conflict are both named). Found
    by building again without them (only on an error: a few dataclass builds) rather than by
    tracking each value's origin through _build, which every check would have to carry."""
    def same_error(kept: list[str]) -> bool:
        try:
            _build(cls, merge(file_tree, parse_overrides(kept)), "")
        except ConfigError as e:
            return str(e) == message
        return False

    if not overrides or same_error([]):
        return f"{path}: {message}" if path else message
    culprits = [o for i, o in enumerate(overrides) if not same_error(overrides[:i] + overrides[i + 1:])] or overrides
    return f"override{'s' if len(culprits) > 1 else ''} {', '.join(repr(o) for o in culprits)}: {message}"


# ----------------------------------------------------------------------------- old keys

# Keys that moved or went (issue 42: config owned by components): old dotted key -> its new dotted
# key, or "removed: why". A YAML file or an override with an old key is an error that says this;
# an old run's config.yaml (written with every key) is migrated instead (migrate_old_keys), so its
# checkpoints still export, infer and serve.
_COMPILE = "compile, CUDA graphs and activation checkpointing have their own sections"
_TOOLS = "tool settings have their own `tools` section"
_TIER = "each tier has only its own keys"
RENAMED: dict[str, str] = {
    "precision.compile": "compile.enabled",
    "precision.compile_vision": "compile.vision",
    "precision.cuda_graphs": "compile.cuda_graphs",
    "precision.cuda_graphs_vision": "compile.cuda_graphs_vision",
    "precision.activation_memory_budget": "compile.activation_memory_budget",
    "precision.gradient_checkpointing": "activation_checkpointing.enabled",
    "precision.checkpoint_every": "activation_checkpointing.every",
    "model.attn_implementation": "model.attention.implementation",
    "model.vision_attention": "model.attention.vision",
    "model.packed_attention": "removed: packed rows under sdpa always attend per sample; the dense block-diagonal "
                              "mask (`mask`) measured slower than padding (docs/benchmarks-log.md)",
    "rollout.engine": "removed: rollouts always run on vlforge's generation engine; transformers' generate loop "
                      "(`hf`) measured slower (bench/generate.py times transformers' generate beside it)",
    "rollout.tools": "tools.names",
    "rollout.tool_turns": "tools.turns",
    "rollout.tool_result_tokens": "tools.result_tokens",
    "rollout.tool_result_chars": "tools.result_chars",
    "rollout.tool_image_max_pixels": "tools.image_max_pixels",
    "rollout.tool_timeout_s": "tools.timeout_s",
    "rollout.tool_processes": "tools.processes",
    "train.router_aux_loss_coef": "loss.router_aux_loss_coef",
    "tiers.language.last_n_blocks": "removed: only the vision tier has blocks to choose (tiers.vision.last_n_blocks)",
    "tiers.projector.last_n_blocks": "removed: only the vision tier has blocks to choose (tiers.vision.last_n_blocks)",
    "tiers.projector.mlp": "removed: the projector is two linears that LoRA always adapts; mlp is a language and "
                           "vision tier key",
    "tiers.projector.experts": "removed: only the language tier has experts (tiers.language.experts)",
    "tiers.projector.router": "removed: only the language tier has a router (tiers.language.router)",
    "tiers.vision.experts": "removed: only the language tier has experts (tiers.language.experts)",
    "tiers.vision.router": "removed: only the language tier has a router (tiers.language.router)",
}


def _old_keys(tree: dict) -> list[str]:
    """The RENAMED keys present in a config tree (a section given as a mapping is walked)."""
    found = []
    for old in RENAMED:
        node = tree
        for part in old.split("."):
            node = node.get(part, dataclasses.MISSING) if isinstance(node, dict) else dataclasses.MISSING
        if node is not dataclasses.MISSING:
            found.append(old)
    return found


def check_old_keys(tree: dict, where: str) -> None:
    """A ConfigError for the first old key in `tree` (`where`: the file or the override), naming its new key."""
    for old in _old_keys(tree):
        new = RENAMED[old]
        if new.startswith("removed"):
            raise ConfigError(f"{where}: '{old}' was {new}; delete it")
        raise ConfigError(f"{where}: '{old}' is now '{new}' ({_why_moved(old)}): rename it")


def _why_moved(old: str) -> str:
    if old.startswith("precision."):
        return _COMPILE
    if old.startswith("rollout.tool"):
        return _TOOLS
    if old.startswith("model."):
        return "attention settings are grouped under model.attention"
    return "the router load-balancing loss is part of the training loss" if old.startswith("train.") else _TIER


def migrate_old_keys(tree: dict) -> dict:
    """`tree` with its old keys moved to their new places, removed ones dropped: an old run's
    config.yaml, read to export, infer or serve its checkpoints, which no removed key affects (they
    chose training and rollout paths; a new run is started from the user's own YAML, checked above)."""
    tree = copy.deepcopy(tree)
    for old in _old_keys(tree):
        *parents, leaf = old.split(".")
        section = tree
        for part in parents:
            section = section[part]
        value = section.pop(leaf)
        new = RENAMED[old]
        if not new.startswith("removed"):
            _set_dotted(tree, new, value)
    return tree
