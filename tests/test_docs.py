"""The docs stay true to the code: docs/config.md is what scripts/config_reference.py writes from
vlforge/config/ now, the README stays a user's few screens, and every docs link resolves."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from vlforge import config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "config.md"


def _script():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections included (a list of dataclasses as `key[]`)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}{f.name}"
        out.append(path)
        if dataclasses.is_dataclass(tp):
            out += _keys(tp, path + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out += _keys(typing.get_args(tp)[0], path + "[].")
    return out


def test_config_reference_is_current():
    written = REFERENCE.read_text(encoding="utf-8")
    if _script().render() != written:
        pytest.fail("docs/config.md is stale: vlforge/config/ changed since it was generated. Run "
                    "`python scripts/config_reference.py` and commit docs/config.md with the config change.")


def test_config_reference_has_every_key_with_its_default():
    """Each key of SFTConfig and GRPOConfig has a row (or a heading) in its section, with the default a run gets."""
    text = _script().render()
    sections = {m.group(1): m.start() for m in re.finditer(r"^#+ `([\w.\[\]]+)`$", text, re.M)}
    for key in _keys(config.GRPOConfig):
        if key in sections:
            continue
        section, name = key.rsplit(".", 1)
        start = sections[section]
        body = text[start:min([s for s in sections.values() if s > start] + [len(text)])]
        assert f"| `{name}` |" in body, f"{key} has no row under {section}"
    # tiers differ only by their defaults: each section shows its own
    language = text[sections["tiers.language"]:sections["tiers.projector"]]
    vision = text[sections["tiers.vision"]:sections["precision"]]
    assert "| `last_n_blocks` |" in vision and "| `last_n_blocks` |" not in language  # each tier its own keys
    assert "| `lr` | `float` | `0.0002` |" in language and "| `train` | `bool` | `false` |" in vision
    assert "`runs/sft` (grpo: `runs/grpo`)" in text  # GRPO's own train defaults are named


def test_config_reference_reads_comments_types_and_ranges():
    """The generator's parsing on a source of its own: comments above and beside a field, a `#`
    inside a string that is no comment, Literal choices, and the ranges of __post_init__."""
    source = '''
@dataclass
class Demo:
    """A demo section."""

    # the first line above
    # and the second
    size: int = 4  # and beside it
    pattern: str = "a#b"
    mode: Literal["x", "y"] | None = None

    def __post_init__(self):
        _range(self, "size", ge=1, lt=9)
        for key in ("size", "other"):
            _range(self, key, gt=0)
'''
    parsed = _script().parse(source)["Demo"]
    assert parsed["doc"] == "A demo section."
    assert parsed["fields"]["size"]["comment"] == "the first line above and the second and beside it"
    assert parsed["fields"]["pattern"]["comment"] == ""
    assert parsed["fields"]["mode"]["type"] == "x | y | null"
    assert parsed["fields"]["size"]["range"] == ["in [1, 9)", "> 0"]


def test_config_reference_takes_another_source(tmp_path):
    """--source reads another config package (e.g. the last commit's): its comments and defaults, not ours."""
    import shutil

    path = tmp_path / "config"
    shutil.copytree(ROOT / "vlforge" / "config", path, ignore=shutil.ignore_patterns("__pycache__"))
    src = (path / "train.py").read_text(encoding="utf-8")
    changed = src.replace("    batch_size: int = 8  # samples per micro-batch",
                          "    batch_size: int = 3  # rows per micro-batch, changed")
    assert changed != src
    (path / "train.py").write_text(changed, encoding="utf-8")
    assert "| `batch_size` | `int` | `3` | rows per micro-batch, changed." in _script().render(path)


def test_readme_is_short_and_keeps_the_ci_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: the manual belongs in docs/ (at most 250 here)"
    text = "\n".join(lines)
    for command in ("python -m pytest -q", "python -m pytest -q -m slow", "python -m pytest -q -m gpu"):
        assert command in text, f"README.md lost the test command `{command}` (CI runs the README's commands)"


def _links(path: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every relative Markdown link in a file, outside code blocks."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        out.append((file, anchor))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_doc_links_resolve(doc):
    for file, anchor in _links(doc):
        target = (doc.parent / file).resolve() if file else doc
        assert target.exists(), f"{doc.relative_to(ROOT)} links {file}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{doc.relative_to(ROOT)} links {file}#{anchor}: no such heading"


def test_readme_indexes_every_guide():
    """The README's docs index links each guide under docs/ (a guide nobody links is a guide nobody reads)."""
    linked = {(README.parent / f).resolve() for f, _ in _links(README) if f}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md's docs index does not link {missing}"
